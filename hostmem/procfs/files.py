"""The ground under every /proc reader: the page size, where a process's files are,
and reading one with an error that names the file and says what to do."""

from __future__ import annotations

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
    except PermissionError:
        raise ProcReadError(
            f"{path}: permission denied (run as the process's user or as root)"
        ) from None
    except OSError as exc:
        raise ProcReadError(f"{path}: {exc.strerror or exc}") from None
