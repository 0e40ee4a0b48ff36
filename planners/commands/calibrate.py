"""``hostmem calibrate [CONFIG]``: measure the cost model's rates on this machine.

Disk sequential read of the cache root and of each checkpoint folder (pages dropped
first), page-cache read, and on a CUDA host host-to-device copies at layer size from
pinned, pageable, mapped and mapped-then-registered memory. Prints the ``transfer:``
block to put in the deployment config (rates the planner reads); without a GPU the
device rates are left out, with a line saying they need one. ``--save`` also writes
them to ``<cache root>/calibration.json``, which ``transfer: measured`` plans with
(:mod:`planners.calibration`).

A folder is timed on a probe file written there where it holds no checkpoint: one its disk
has no room for is refused before a byte is written, and the probe is removed after, also
when the command fails or is stopped (Ctrl-C, SIGTERM).
"""

from __future__ import annotations

import json
import os

from hostmem.errors import InputError
from hostmem.units import format_rate, format_size, size_option

def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="measure disk, page-cache and host-to-device rates; print the transfer: block",
        description=(
            "Measure what the cost model needs on this machine: a sequential read of the cache root and of "
            "each checkpoint folder with its pages dropped first (the disk), the same read cached (the page "
            "cache), and on a CUDA host the host-to-device copy rates at layer size. Prints the transfer: "
            "block for the deployment config. Dropping a checkpoint's pages makes a server using it re-read them."
        ),
    )
    parser.add_argument("config", nargs="?", metavar="CONFIG", help="a deployment config: its checkpoints and cache root")
    parser.add_argument("--path", action="append", default=[], metavar="DIR", help="another folder to time (repeatable)")
    parser.add_argument("--root", metavar="DIR", default=None,
                        help="cache root (default: lora.cache.root, else $HOSTMEM_CACHE_ROOT, else ~/.cache/hostmem)")
    parser.add_argument("--size", type=size_option, default=None,
                        help="bytes read per folder (default: the config's largest layer, from 64MiB to 1GiB, "
                        "else 256MiB): a file smaller than this is not timed as the disk")
    parser.add_argument("--layer-size", type=size_option, default=None,
                        help="bytes per device copy (default: the config's largest layer, else 64MiB)")
    parser.add_argument("--device", default=None, help="the GPU to time copies to, e.g. cuda:0 (default: cuda:0 if any)")
    parser.add_argument("--json", action="store_true", help="print JSON (rates in bytes per second)")
    parser.add_argument("--save", action="store_true",
                        help="also write the rates to <cache root>/calibration.json, what transfer: measured plans with")
    parser.set_defaults(run=run)


def cache_root(args, config) -> str:
    """``--root``, else the config's ``lora.cache.root``, else the default root, as the
    plan that reads the record finds it (``$HOSTMEM_CACHE_ROOT``, else ``$XDG_CACHE_HOME/hostmem``,
    else ``~/.cache/hostmem``)."""
    from hostmem.vault.combinations import default_cache_root

    root = args.root or (config.lora.cache.root if config is not None and config.lora is not None else None)
    return os.path.expanduser(root or default_cache_root())


def _folders(args, config) -> list[tuple[str, bool]]:
    """``(folder, existing)``: checkpoint folders are read as they are, others get a probe file."""
    out = []
    root = cache_root(args, config)
    if os.path.isdir(root):
        out.append((root, False))
    if config is not None:
        for component in config.components.values():
            if component.path is not None:
                folder = component.path if os.path.isdir(component.path) else os.path.dirname(component.path)
                out.append((folder, True))
    out += [(os.path.abspath(p), True) for p in args.path]
    seen, unique = set(), []
    for folder, existing in out:
        if folder not in seen:
            seen.add(folder)
            unique.append((folder, existing))
    return unique


def _layer_bytes(args, config) -> int:
    if args.layer_size:
        return args.layer_size
    if config is not None:
        from planners.whatif import checkpoint_sizes

        sizes = checkpoint_sizes(config)
        largest = max((u.nbytes for s in sizes.values() for u in s.layers), default=0)
        if largest:
            return largest
    return size_option("64MiB")


def _device(args, use_device: bool) -> tuple[str | None, str | None]:
    """The device to time, or None and the reason the device rates are left out."""
    if not use_device:
        return None, "the device rates were not measured (asked not to touch the device)"
    import torch

    if not torch.cuda.is_available():
        if args.device:
            raise InputError(f"--device {args.device}: this host has no CUDA device; run without --device to "
                             "measure the host rates")
        return None, "the device rates (pinned_h2d, pageable_h2d) need a GPU: run hostmem calibrate on a CUDA host"
    return args.device or "cuda:0", None


_MIN_PROBE, _MAX_PROBE = 64 << 20, 1 << 30


def probe_bytes(args, config) -> int:
    """Bytes read per folder: ``--size``, else a streamed layer's size (what the executor reads
    from disk at a time), kept from 64 MiB to 1 GiB, else 256 MiB."""
    if args.size:
        return args.size
    if config is not None:
        layer = _layer_bytes(args, config)
        return max(_MIN_PROBE, min(layer, _MAX_PROBE))
    return size_option("256MiB")


def _time_folders(folders, size: int) -> tuple[list, list[str]]:
    """``(rates, notes)``: a checkpoint file smaller than ``size`` is too small to time the disk
    (a read's fixed costs and the per-file read-ahead ramp dominate), so a probe of ``size``
    is timed in its folder too, where it can be written, and only that counts as the disk."""
    from planners.executor.rates import measure_folder, probe_refusal

    measured, notes = [], []
    for folder, existing in folders:
        m = measure_folder(folder, size, existing)
        measured.append(m)
        if m.probe or m.nbytes >= size:
            continue
        small = f"{folder}: its largest checkpoint file is {format_size(m.nbytes)}, too small to time the disk"
        if not os.access(folder, os.W_OK):
            notes.append(f"{small}, and the folder is not writable for a probe: not used for disk_read")
        elif probe_refusal(folder, size):
            notes.append(f"{small}, and its disk has no room for a {format_size(size)} probe: not used for disk_read")
        else:
            measured.append(measure_folder(folder, size, existing=False))
            notes.append(f"{small}; timed a {format_size(size)} probe there instead")
    return measured, notes


def explain(measured) -> list[str]:
    """Readings that look wrong, and what they likely mean."""
    out = []
    for m in measured:
        if m.page_cache_read < m.disk_read:
            out.append(
                f"{m.folder}: the page cache read ({format_rate(m.page_cache_read)}) is slower than the disk read "
                f"({format_rate(m.disk_read)}): the disk was likely served from a cache below this kernel (a "
                "virtual disk's host cache, a controller's), or the machine was busy; the disk figure is then "
                "optimistic. Run again on an idle machine, or with a larger --size")
    return out


def measure(args, use_device: bool = True) -> dict:
    """What ``hostmem calibrate`` prints, as a dict (rates in bytes per second)."""
    from planners.config import load_config
    from planners.executor.rates import h2d_rates

    config = load_config(args.config) if args.config else None
    folders = _folders(args, config)
    if not folders:
        raise InputError("nothing to time: the cache root does not exist; give a CONFIG or --path DIR")
    size = probe_bytes(args, config)
    measured, notes = _time_folders(folders, size)
    timed = [m for m in measured if m.probe or m.nbytes >= size] or measured
    device, note = _device(args, use_device)
    transfer = {"disk_read": min(m.disk_read for m in timed)}
    folders_out = [{**m._asdict(), "used_for_disk_read": m in timed} for m in measured]
    result = {"folders": folders_out, "device": device, "probe_bytes": size,
              "notes": notes + explain(measured) + ([note] if note else [])}
    readers = min(timed, key=lambda m: m.disk_read).readers  # the slowest folder: where read-ahead matters
    if readers:
        result["read_ahead"] = {"reader": min(readers, key=readers.get), "seconds": readers}
    if device is not None:
        layer = _layer_bytes(args, config)
        source = max(measured, key=lambda m: m.nbytes)
        rates = h2d_rates(device, layer, source.file) if not source.probe and source.nbytes >= layer else None
        if rates is None:  # the probe is gone, or the file is smaller than a layer: map a probe of layer size
            from planners.executor.rates import probe_file

            with probe_file(source.folder, layer, "--layer-size") as probe:
                rates = h2d_rates(device, layer, probe)
        result["h2d"] = {"layer_bytes": layer, **rates}
        transfer.update(pinned_h2d=rates["pinned_h2d"], pageable_h2d=rates["pageable_h2d"])
    result["transfer"] = transfer
    if getattr(args, "save", False):
        from planners.calibration import record_path, save_record

        result["saved"] = save_record(result, record_path(root=cache_root(args, config)))
    return result


def transfer_block(transfer: dict) -> str:
    """The ``transfer:`` block of a deployment config, in GB/s (what ``parse_rate`` reads)."""
    lines = ["transfer:"]
    for key in ("pinned_h2d", "pageable_h2d", "disk_read"):
        if key in transfer:
            lines.append(f"  {key}: {transfer[key] / 1e9:.2f}GB/s")
    return "\n".join(lines)


def run(args) -> int:
    from .stopping import stoppable

    with stoppable(armed=False) as stop:  # SIGTERM too stops it as Ctrl-C does, and the probe file is removed
        import torch  # noqa: F401  (measure's device rates import it: before a signal may raise, see .stopping)

        stop.arm()
        result = measure(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    for folder in result["folders"]:
        what = "probe file" if folder["probe"] else os.path.basename(folder["file"])
        unused = "" if folder["used_for_disk_read"] else " (too small: not the disk rate)"
        print(f"{folder['folder']}: disk {format_rate(folder['disk_read'])}, page cache "
              f"{format_rate(folder['page_cache_read'])} ({format_size(folder['nbytes'])} of {what}){unused}")
    if "h2d" in result:
        h2d = result["h2d"]
        rates = ", ".join(f"{k.removesuffix('_h2d')} {format_rate(v)}" for k, v in h2d.items() if k != "layer_bytes")
        print(f"{result['device']}: host to device at {format_size(h2d['layer_bytes'])}: {rates}")
    if "read_ahead" in result:
        print(f"read-ahead: {result['read_ahead']['reader']} is the fastest reader here (what read_ahead: auto "
              "uses once saved)")
    for note in result["notes"]:
        print(f"note: {note}")
    if "saved" in result:
        print(f"saved to {result['saved']}: a config with transfer: measured plans with these rates")
    print()
    print(transfer_block(result["transfer"]))
    return 0
