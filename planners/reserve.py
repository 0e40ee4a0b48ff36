"""A host reserve measured from a warmup request, remembered per deployment.

``host.reserve: 4GiB`` is a guess. With ``host.reserve: measured`` the server runs one
warmup request under the peak tracker (:func:`measure_reserve`, :mod:`hostmem.peak`:
RssAnon sampled from outside the process every millisecond, so a copy-on-write spike
is seen too), and the reserve is that request's anonymous growth beyond what was
resident before it (the weights, Python, the CUDA context), never less than
``host.reserve_floor``. The figure is written to a small JSON file per deployment in
the user's cache root (``lora.cache.root``, else ``$HOSTMEM_CACHE_ROOT``, else
``~/.cache/hostmem``; the folder must be the user's own, as for the vault), so the
next start plans with it from its first plan on. Until a warmup has run, the floor
stands and the report says so. A size written in the config (or
``HOSTMEM_HOST_RESERVE``) always wins.

A measured reserve is one request's growth alone, so a live plan counts the
process's own anonymous memory beyond the weights as committed in full
(:func:`process_excess`), where a configured reserve is meant to cover it.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Callable, NamedTuple

from hostmem.units import format_size

__all__ = ["MEASURED", "MeasuredReserve", "measure_reserve", "remembered", "read_reserve", "resolve_reserve", "process_excess",
           "is_measured", "record_path", "DEFAULT_RESERVE", "DEFAULT_FLOOR"]

MEASURED = "measured"
DEFAULT_RESERVE = 4 * 1024**3  # host.reserve when the config says nothing
DEFAULT_FLOOR = 1024**3  # host.reserve_floor: the least a measured reserve may be
_FORMAT = "hostmem-reserve/1"
_FOLDER = "reserves"


class MeasuredReserve(NamedTuple):
    """What one warmup measured: bytes, as the JSON record holds them."""

    deployment: str
    growth_bytes: int  # peak RssAnon during the warmup minus the baseline before it
    baseline_bytes: int
    peak_bytes: int
    samples: int
    max_gap_s: float
    measured_at: str  # UTC, ISO 8601

    def reserve(self, floor: int) -> int:
        return max(floor, self.growth_bytes)

    def source(self, floor: int) -> str:
        """How the report names it."""
        held = "the floor" if self.growth_bytes < floor else "measured"
        return (f"measured: a warmup grew {format_size(self.growth_bytes)} at {self.measured_at} "
                f"(floor {format_size(floor)}; {held} stands)")


def _root(config) -> str:
    from hostmem.vault.combinations import default_cache_root

    cache = config.lora.cache if config.lora is not None else None
    return os.path.abspath(os.path.expanduser((cache.root if cache is not None else None) or default_cache_root()))


def _digest(name: str) -> str:
    import hashlib  # a plan reads records without it; only naming one computes this

    return hashlib.sha256(name.encode()).hexdigest()[:12]


def _now() -> str:
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def record_path(config) -> str:
    """``<cache root>/reserves/<deployment>-<digest>.json``: a basename that cannot leave
    the folder, unique per deployment name."""
    name = config.deployment
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:64].lstrip(".") or "deployment"
    return os.path.join(_root(config), _FOLDER, f"{safe}-{_digest(name)}.json")


_MOST_BYTES = 1 << 60  # an EiB: a figure beyond it is no measurement of one request


def _is_count(value, most: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= most


def _why_not(data, config) -> str | None:
    """Why ``data`` is not a measurement of this deployment (types, finite numbers in
    range), or None: a record is checked whoever wrote it."""
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        return f"not a record of {_FORMAT}"
    if data.get("deployment") != config.deployment:
        return f"a record of deployment {data.get('deployment')!r}"
    missing = [k for k in MeasuredReserve._fields if k not in data]
    if missing:
        return f"no {', '.join(missing)}"
    bad = [k for k in ("growth_bytes", "baseline_bytes", "peak_bytes") if not _is_count(data[k], _MOST_BYTES)]
    if not _is_count(data["samples"], 1 << 40):
        bad.append("samples")
    gap = data["max_gap_s"]
    if not (isinstance(gap, (int, float)) and not isinstance(gap, bool) and math.isfinite(gap) and gap >= 0):
        bad.append("max_gap_s")
    if not isinstance(data["measured_at"], str) or len(data["measured_at"]) > 64:
        bad.append("measured_at")
    if bad:
        return f"{', '.join(bad)}: not a count of bytes (or seconds) in range"
    return None


def read_reserve(config) -> tuple[MeasuredReserve | None, str | None]:
    """``(the deployment's last measurement, None)``, or ``(None, why there is none)``:
    none yet, or a record that is not the user's own, not a file, or not valid."""
    from .record_file import read_own_json

    path = record_path(config)
    data, unread = read_own_json(path)
    if data is None:
        return None, unread
    why = _why_not(data, config)
    if why is not None:
        return None, f"{path} is not used ({why}); remove it, or run the warmup again"
    return MeasuredReserve(**{k: data[k] for k in MeasuredReserve._fields}), None


def remembered(config) -> MeasuredReserve | None:
    """The deployment's last measurement, or None (none yet, or a record not the user's own or not valid)."""
    return read_reserve(config)[0]


def resolve_reserve(config):
    """``config`` with ``host.reserve`` resolved: a measured one from the deployment's
    record (else the default until a warmup runs); any other config as it is."""
    host = config.host
    if host.reserve_source != MEASURED:
        return config
    record, why = read_reserve(config)
    if record is None:
        reserve = host.reserve_floor
        source = (f"measured: no warmup yet, the floor {format_size(reserve)} stands until one runs "
                  "(planners.reserve.measure_reserve)")
        if why is not None:
            source = (f"measured: no warmup yet that can be used ({why}); the floor {format_size(reserve)} stands "
                      "until one runs (planners.reserve.measure_reserve)")
    else:
        reserve, source = record.reserve(host.reserve_floor), record.source(host.reserve_floor)
    return config._replace(host=host._replace(reserve=reserve, reserve_source=source))


def is_measured(config) -> bool:
    return config.host.reserve_source.startswith(MEASURED)


def process_excess(unattributed_anonymous: int, config) -> int:
    """Anonymous memory no weight explains that a live plan commits: all of it under a
    measured reserve (one request's growth), what exceeds a configured one otherwise."""
    if is_measured(config):
        return max(0, unattributed_anonymous)
    return max(0, unattributed_anonymous - config.host.reserve)


def _write(config, record: MeasuredReserve) -> str:
    from hostmem.vault.durable import durable_write
    from hostmem.vault.safety import make_private_dir, prepare_root

    prepare_root(_root(config))  # the user's own folder, not tmpfs, not writable by others
    path = record_path(config)
    make_private_dir(os.path.dirname(path))
    durable_write(path, (json.dumps({"format": _FORMAT, **record._asdict()}, indent=1) + "\n").encode())
    return path


def measure_reserve(config, warmup: Callable[[], object], *, interval_s: float | None = None):
    """Run ``warmup`` (one request as the server serves it) under the peak tracker,
    remember its anonymous growth for this deployment, and return ``(config, record)``:
    the config with the measured reserve in place (plan again with it), and what was measured.

    Only a config with ``host.reserve: measured`` is measured: a configured size wins, and
    is returned as it is with ``None``.
    """
    from hostmem.peak import DEFAULT_INTERVAL_S, track_peak_anon

    if not is_measured(config):
        return config, None
    with track_peak_anon(interval_s=interval_s or DEFAULT_INTERVAL_S) as peak:
        warmup()
    figures = peak.figures()
    record = MeasuredReserve(
        config.deployment, figures.growth_bytes, figures.baseline_bytes, figures.peak_bytes, figures.samples,
        round(figures.max_gap_s, 6), _now(),
    )
    try:
        _write(config, record)
    except (OSError, ValueError) as exc:  # a full disk, a refused root (VaultError is a ValueError)
        from hostmem.vault.locks import say

        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        say(f"{record_path(config)}: the measured reserve could not be recorded ({why}); it is used by this "
            "start, and the next start measures again")
    host = config.host._replace(reserve=record.reserve(config.host.reserve_floor),
                                reserve_source=record.source(config.host.reserve_floor))
    return config._replace(host=host), record
