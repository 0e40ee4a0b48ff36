"""The rates ``hostmem calibrate --save`` measured, remembered for ``transfer: measured``.

``transfer:`` rates written in a config are guesses or another machine's. ``hostmem
calibrate --save`` writes what it measured on this machine to a small JSON record in
the user's cache root (``lora.cache.root``, else ``$HOSTMEM_CACHE_ROOT``, else
``~/.cache/hostmem``, or ``--root``; the folder must be the user's own, as for the
vault), and a config with ``transfer: measured`` plans with those rates, naming the
record in the report. Until a calibration is saved, or for a rate it could not measure
(the device rates need a GPU), the defaults stand and the report says so. The record
also names the read-ahead reader that was fastest here (``read_ahead``), which the
executor's ``read_ahead: auto`` uses (:func:`saved_reader`).
"""

from __future__ import annotations

import json
import math
import os

from hostmem.units import format_rate

__all__ = ["MEASURED", "RECORD", "describe", "record_path", "read_calibration", "read_record", "resolve_transfer",
           "save_record", "saved_reader"]

MEASURED = "measured"
RECORD = "calibration.json"
_FORMAT = "hostmem-calibration/1"
_RATES = ("pinned_h2d", "pageable_h2d", "disk_read")


def _root(config) -> str:
    from hostmem.vault.combinations import default_cache_root

    cache = config.lora.cache if config is not None and config.lora is not None else None
    return os.path.abspath(os.path.expanduser((cache.root if cache is not None else None) or default_cache_root()))


def record_path(config=None, root: str | None = None) -> str:
    """``<cache root>/calibration.json``: ``root`` if given, else the config's cache root."""
    return os.path.join(os.path.abspath(os.path.expanduser(root)) if root else _root(config), RECORD)


def save_record(result: dict, path: str) -> str:
    """Write calibrate's ``result`` (its ``transfer`` rates, what was timed) to ``path``; return it."""
    from hostmem.vault.durable import durable_write
    from hostmem.vault.safety import VaultError, prepare_root

    prepare_root(os.path.dirname(path))  # the user's own folder, not tmpfs, not writable by others
    import datetime  # only when a record is written: the plan reads records without it

    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    record = {"format": _FORMAT, "measured_at": when, "transfer": result["transfer"], "device": result.get("device"),
              "folders": result.get("folders", []), "h2d": result.get("h2d"), "read_ahead": result.get("read_ahead")}
    try:
        durable_write(path, (json.dumps(record, indent=1, allow_nan=False) + "\n").encode())
    except (OSError, ValueError) as exc:  # a full disk; a rate that is no number
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise VaultError(f"{path}: the calibration could not be written ({why}); free room there or give "
                         "another cache root (--root DIR), and run `hostmem calibrate --save` again") from None
    return path


_SLOWEST, _FASTEST = 1e6, 1e14  # bytes/s: below 1 MB/s is no measurement (the config refuses it too), above 100 TB/s none either


def _is_rate(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and _SLOWEST <= value <= _FASTEST)


def _why_not(data) -> str | None:
    """Why ``data`` is not a calibration (types, finite rates in range), or None: a record
    is checked whoever wrote it."""
    rates = data.get("transfer") if isinstance(data, dict) else None
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        return f"not a record of {_FORMAT}"
    if not isinstance(rates, dict) or "disk_read" not in rates:
        return "no transfer rates (disk_read at least)"
    bad = [k for k in _RATES if k in rates and not _is_rate(rates[k])]
    if bad:
        return (f"{', '.join(f'{k}={rates[k]!r}' for k in bad)}: not a rate in bytes/s between "
                f"{_SLOWEST:.0e} and {_FASTEST:.0e}")
    if not isinstance(data.get("measured_at", ""), str):
        return "measured_at is not a time"
    return None


def read_calibration(path: str) -> tuple[dict | None, str | None]:
    """``(the record at path, None)``, or ``(None, why there is none)``: None where none is
    saved yet, else what is wrong (not the user's own, not a file, not a valid calibration)."""
    from .record_file import read_own_json

    data, unread = read_own_json(path)
    if data is None:
        return None, unread
    why = _why_not(data)
    return (data, None) if why is None else (None, f"{path} is not used ({why}); remove it or calibrate again")


def read_record(path: str) -> dict | None:
    """The record at ``path``, or None (none yet, not the user's own, or not a calibration)."""
    return read_calibration(path)[0]


def saved_reader(config=None) -> str | None:
    """The read-ahead reader ``hostmem calibrate --save`` found fastest on this machine, or None.

    The executor has a plan, not a config: it reads the record of the default cache root
    (``$HOSTMEM_CACHE_ROOT``, else ``~/.cache/hostmem``), where a calibration without
    ``--root`` or a config's cache root is saved."""
    record = read_record(record_path(config))
    choice = record.get("read_ahead") if record is not None else None
    return choice.get("reader") if isinstance(choice, dict) and isinstance(choice.get("reader"), str) else None


def resolve_transfer(config):
    """``config`` with ``transfer: measured`` resolved from the record; any other config as it is."""
    transfer = config.transfer
    if transfer.source != MEASURED:
        return config
    path = record_path(config)
    record, why = read_calibration(path)
    if record is None:
        source = (f"measured: no calibration saved at {path} yet, the defaults stand until "
                  "`hostmem calibrate --save` runs on this machine")
        if why is not None:
            source = f"measured: {why}; the defaults stand until `hostmem calibrate --save` runs on this machine"
        return config._replace(transfer=transfer._replace(source=source))
    rates = {k: float(record["transfer"][k]) for k in _RATES if k in record["transfer"]}
    missing = [k for k in _RATES if k not in rates]
    source = f"measured by hostmem calibrate at {record.get('measured_at', '?')} ({path})"
    if missing:
        source += f"; {', '.join(missing)}: the defaults (measured without a GPU)"
    return config._replace(transfer=transfer._replace(**rates, source=source))


def describe(transfer) -> str:
    """The rates and where they came from, as the report shows them."""
    source = {"default": "the defaults: the config has no transfer: block",
              "config": "the config's transfer: block"}.get(transfer.source, transfer.source)
    return (f"pinned {format_rate(transfer.pinned_h2d)}, pageable {format_rate(transfer.pageable_h2d)}, "
            f"disk {format_rate(transfer.disk_read)} ({source})")
