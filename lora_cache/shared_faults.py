"""What a shared build's ranks say when something fails: a rank that died, a disk with no room.

A rank killed in a shared build (:mod:`lora_cache.shared_build`) leaves the others
with whatever torch.distributed saw: the rank that hosts the group's store waits for it
and names it when ``rank_timeout`` runs out, but every other rank loses the store with
it when that rank is the one that died, and says only "Broken pipe" or
``DistNetworkError``. The ranks of one host can see each other's processes, so each
notes the others' process ids (and start times, against a reused id) when they first
meet, and on a failed meeting looks which of them has ended (:class:`RankWatch`).

A full disk is not an error of the build: the merged weights can always be made in
place. :func:`cannot_store` tells such a failure (no room, or a folder that could not be
made) from the rest, so that every rank falls back together, each with one warning.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
import warnings

from hostmem.errors import HostmemError
from hostmem.procfs.stat import read_stat

__all__ = ["RankDiedError", "RankWatch", "cannot_store", "storing", "this_process", "warn_in_place"]

NO_ROOM = tuple(os.strerror(code) for code in (errno.ENOSPC, errno.EDQUOT)) + ("no room for",)
SETTLE_SECONDS = 2.0  # a killed process closes its sockets a moment before the kernel marks it ended


class RankDiedError(HostmemError, RuntimeError):
    """A rank of this host ended during a shared build (named, with its process id)."""


def _started(pid: int) -> int | None:
    """The start time of live process ``pid`` (clock ticks since boot), None once it has
    ended (gone, or a zombie waiting for its parent) or where this process cannot see it."""
    try:
        found = read_stat(pid)
    except (OSError, IndexError, ValueError):
        return None
    return None if found.exited or found.state == "x" else found.start_ticks


def this_process() -> tuple[int, int | None]:
    """``(pid, start time)`` of this process: what a rank hands the others when they meet."""
    return os.getpid(), _started(os.getpid())


class RankWatch:
    """The processes of this host's ranks, as handed round when they met: ``[(rank, (pid,
    start time)), ...]``. Only those this process could see then are judged later."""

    def __init__(self, met: list, me: int):
        self.me = me
        self.processes = {rank: (pid, started) for rank, (pid, started) in met
                          if started is not None and _started(pid) == started}

    def dead(self) -> list[tuple[int, int]]:
        """``[(rank, pid), ...]`` of the watched ranks whose process has ended."""
        return [(rank, pid) for rank, (pid, started) in self.processes.items() if _started(pid) != started]

    @contextlib.contextmanager
    def naming_the_dead(self, what: str):
        """Within: a failed meeting of the ranks (torch's errors are RuntimeErrors) raises
        :class:`RankDiedError` naming the rank whose process ended, where one has (waiting
        :data:`SETTLE_SECONDS` for the kernel to say so); else the error as it was."""
        try:
            yield
        except RuntimeError as exc:
            if isinstance(exc, RankDiedError):
                raise
            settle = SETTLE_SECONDS if _from_a_meeting(exc) else 0.0
            dead, deadline = self.dead(), time.monotonic() + settle
            while not dead and time.monotonic() < deadline:
                time.sleep(0.05)
                dead = self.dead()
            if not dead:
                raise
            who = ", ".join(f"rank {rank} (pid {pid})" for rank, pid in dead)
            raise RankDiedError(
                f"{who} died during {what}: its process ended, so this rank ({self.me}) stops too; "
                f"look in that rank's log for why it ended, then start every rank again: what was sealed "
                f"stays and is resumed. torch said: {_first_line(exc)}") from None


def _from_a_meeting(exc: BaseException) -> bool:
    """Whether ``exc`` is torch.distributed's (a lost connection, a timeout) or a gather's."""
    import torch.distributed as dist

    from hostmem.host_ledger import HostGatherError

    return isinstance(exc, (HostGatherError, getattr(dist, "DistError", HostGatherError)))


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def cannot_store(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) says the disk had no room."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(words in str(exc) for words in NO_ROOM):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def storing(step, key) -> tuple:
    """Run ``step``, a write the lowest rank makes alone: ``(what it returned, None)``, or
    ``(None, why the shared build of ``key`` could not be stored)``."""
    from hostmem.vault import VaultError

    try:
        return step(), None
    except (OSError, VaultError) as exc:
        return None, f"the LoRA merge cache could not store the shared build of {key.hex[:12]} ({exc})"


def warn_in_place(outcome, reason: str):
    """Every rank of the host merges in place: ``reason`` said once, as a warning, and kept
    in ``outcome.in_place`` (``merge`` then opens no cache)."""
    outcome.in_place = reason
    message = f"{reason}; every rank of this host merges in place instead"
    warnings.warn(message)
    return outcome
