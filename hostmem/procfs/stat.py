"""A process's state, parent, flags and start time, from /proc/PID/stat."""

from __future__ import annotations

from typing import NamedTuple

from .files import proc_path

__all__ = ["ProcStat", "read_stat"]

PF_KTHREAD = 0x00200000  # the flags bit of a kernel thread


class ProcStat(NamedTuple):
    """The fields of /proc/PID/stat used here, by name."""

    state: str  # R, S, D, Z (a zombie), X (dead), ...
    ppid: int
    flags: int
    start_ticks: int  # when it started, clock ticks after boot: with the pid, names one process

    @property
    def exited(self) -> bool:
        """A zombie its parent has not reaped, or a process being torn down."""
        return self.state in ("Z", "X")

    @property
    def kernel_thread(self) -> bool:
        return bool(self.flags & PF_KTHREAD)


def read_stat(pid: int | None = None) -> ProcStat:
    """The state, parent pid, flags and start time of a process. The command name (field 2) may hold
    spaces and parentheses, so the fields are read after its last ``)``. Raises OSError
    as reading the file does (FileNotFoundError or ProcessLookupError once it is gone)."""
    with open(proc_path(pid, "stat"), "rb") as handle:
        fields = handle.read().rsplit(b")", 1)[1].split()
    return ProcStat(fields[0].decode(), int(fields[1]), int(fields[6]), int(fields[19]))
