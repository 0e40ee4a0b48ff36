"""A process's I/O counters (``/proc/PID/io``): what it made the block layer read."""

from __future__ import annotations

from .files import ProcReadError, proc_path, read_text

__all__ = ["read_io_bytes"]


def read_io_bytes(pid: int | None = None) -> int:
    """``read_bytes`` of /proc/PID/io: bytes the process (all its threads) caused to be read
    from storage. A read the page cache served costs nothing, so this is the disk's figure."""
    path = proc_path(pid, "io")
    for line in read_text(path).splitlines():
        key, _, value = line.partition(":")
        if key == "read_bytes":
            return int(value)
    raise ProcReadError(f"{path}: no read_bytes line (a kernel without task I/O accounting)")
