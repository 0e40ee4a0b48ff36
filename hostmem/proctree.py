"""A process and everything it started: find it, and end it without a gap.

``hostmem guard`` must never leave a command running unguarded: when it cannot track
the command, or an interrupt outlives its grace period, the command and every
descendant are killed. Walking the tree while it forks could miss a child started
behind the walk, so each process is stopped (SIGSTOP) before its children are
listed, and only then is every stopped process killed.

Children are found from /proc (each process's parent in ``/proc/PID/stat``), not
through psutil: the guard starts in a fraction of the time importing psutil takes.
"""

from __future__ import annotations

import os
import signal

from .procfs.stat import read_stat

__all__ = ["kill_tree", "signal_tree", "children_of", "descendants_of"]


def _parent_of(pid: int) -> int | None:
    """The parent pid from ``/proc/PID/stat``, or None once the process is gone."""
    try:
        return read_stat(pid).ppid
    except (OSError, ValueError, IndexError):
        return None


def _parents() -> dict[int, int]:
    """``{pid: parent pid}`` of every process visible now."""
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (parent := _parent_of(int(name))) is not None:
            found[int(name)] = parent
    return found


def children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` now."""
    return sorted(child for child, parent in _parents().items() if parent == pid)


def descendants_of(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first), from one look at /proc."""
    parents = _parents()
    found, frontier = [], [pid]
    while frontier:
        level = {child for child, parent in parents.items() if parent in frontier}
        frontier = sorted(level - set(found) - {pid})
        found.extend(frontier)
    return found


def _send(pid: int, signum: int) -> bool:
    """Send ``signum``; False when the process is gone or not ours to signal."""
    try:
        os.kill(pid, signum)
        return True
    except OSError:
        return False


def signal_tree(pid: int, signum: int) -> int:
    """Send ``signum`` to ``pid`` and each live descendant, as a terminal sends Ctrl-C
    to every process in its foreground group; returns how many were sent it."""
    if _parent_of(pid) is None:
        return 0
    return sum(_send(process, signum) for process in [pid, *descendants_of(pid)])


def kill_tree(pid: int) -> int:
    """SIGKILL ``pid`` and every descendant it has started; returns how many were killed.

    The processes are not reaped here: the root is its parent's to wait for, and the
    descendants, re-parented when their parents die, are reaped by their new parent.
    """
    stopped: list[int] = []
    todo = [pid]
    while todo:
        process = todo.pop()
        if process in stopped or not _send(process, signal.SIGSTOP):  # gone already, or not ours
            continue
        stopped.append(process)
        todo.extend(children_of(process))
    return sum(_send(process, signal.SIGKILL) for process in reversed(stopped))
