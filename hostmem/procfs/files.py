"""The ground under every /proc reader: the page size, where a process's files are,
and reading one with an error that names the file and says what to do."""

from __future__ import annotations

import errno
import os

from ..errors import HostmemError

__all__ = ["PAGE_SIZE", "ProcReadError", "proc_path", "read_text"]

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


class ProcReadError(HostmemError, OSError):
    """A /proc or cgroup file could not be read; the message names the file."""


def proc_path(pid: int | None, name: str) -> str:
    """Return ``/proc/<pid>/<name>`` (``/proc/self/<name>`` when ``pid`` is None)."""
    return f"/proc/{'self' if pid is None else int(pid)}/{name}"


def read_text(path: str) -> str:
    """The whole file as text; a missing or unreadable one raises :class:`ProcReadError`."""
    try:
        with open(path, "r", encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except FileNotFoundError:
        raise ProcReadError(
            f"{path}: not found (the process may have exited, or this is not Linux)"
        ) from None
    except PermissionError as exc:
        raise ProcReadError(_refused(path, exc)) from None
    except OSError as exc:
        raise ProcReadError(f"{path}: {exc.strerror or exc}") from None


def _refused(path: str, exc: OSError) -> str:
    """The line for ``path`` refused with ``exc`` (EACCES, EPERM): what to do, or, where this
    already runs as root (so "run as root" would help no one), what refuses root."""
    if os.geteuid() != 0:
        return f"{path}: permission denied (run as the process's user or as root)"
    name = errno.errorcode.get(exc.errno, str(exc.errno))
    return f"{path}: permission denied ({name}) although this runs as root: {_what_refuses_root(path)}"


_CAP_SYS_PTRACE = 19


def _what_refuses_root(path: str) -> str:
    """Why root may not read ``path``, from what this process can see of itself and the kernel."""
    parts = path.split("/")
    if len(parts) < 4 or parts[1] != "proc" or not parts[2].isdigit():
        return "a security module or the filesystem refuses it even to root; read it on the host, outside any sandbox"
    pid, where = parts[2], "run hostmem inspect on the host, outside the container or sandbox"
    uid_map = _first_line("/proc/self/uid_map").split()
    if uid_map and uid_map != ["0", "0", "4294967295"]:
        return (f"this is root of a user namespace only (/proc/self/uid_map: {' '.join(uid_map)}), and pid {pid} is "
                f"outside it; {where}")
    scope = _first_line("/proc/sys/kernel/yama/ptrace_scope")
    if scope == "3":
        return ("kernel.yama.ptrace_scope is 3, which lets no process read another's memory maps, root included "
                "(it stays until a reboot)")
    status = _first_line("/proc/self/status", "CapEff:").split()
    if len(status) == 2 and not int(status[1], 16) >> _CAP_SYS_PTRACE & 1:
        return ("this process lacks CAP_SYS_PTRACE, which reading another process's maps takes (as a container's "
                f"root often does): start the container with that capability, or {where}")
    return ("the kernel refused the ptrace read access that file needs, though this process holds CAP_SYS_PTRACE "
            "and kernel.yama.ptrace_scope allows it: a security module, or the sandbox this runs in, guards pid "
            f"{pid}; {where}")


def _first_line(path: str, prefix: str = "") -> str:
    """The first line of ``path`` that starts with ``prefix``, stripped; "" where there is none."""
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            return next((line.strip() for line in handle if line.startswith(prefix)), "")
    except OSError:
        return ""
