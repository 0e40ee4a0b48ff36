"""What a shared build's ranks say when something fails: a rank that died, a disk with no room.

A rank killed in a shared build (:mod:`lora_cache.shared_build`) leaves the others
with whatever torch.distributed saw: the rank that hosts the group's store waits for it
until ``rank_timeout`` runs out, and every other rank loses the store with it when that
rank is the one that died, and says only "Broken pipe" or ``DistNetworkError``. The
ranks of one host can see each other's processes, so each rank publishes its process
id (and start time, against a reused id) in the group's store before anything else
(:class:`PeerWatch`), reads the others' as they appear, and looks which of them has
ended every quarter of a second while a gather waits
(:func:`hostmem.host_ledger.watching`) and after any failed meeting: the rank that
died is named (rank and pid) on every surviving rank at once, and every one of them
merges in place with one warning. A rank that never published (it died, or never
came, before the build began) is told from a slow one only by ``rank_timeout``.

A full disk is not an error of the build: the merged weights can always be made in
place. :func:`cannot_store` tells such a failure (no room, or a folder that could not be
made) from the rest, so that every rank falls back together, each with one warning.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
import warnings

from hostmem.errors import HostmemError
from hostmem.procfs.stat import read_stat

__all__ = ["PeerWatch", "RankDiedError", "RankWatch", "cannot_store", "storing", "this_process", "warn_in_place"]

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
            raise RankDiedError(self.message(dead, what, exc)) from None

    def message(self, dead: list[tuple[int, int | None]], what: str, exc: BaseException | None) -> str:
        """What every surviving rank says of the ``dead`` ranks."""
        who = ", ".join(f"rank {rank} (pid {pid})" if pid is not None else
                        f"rank {rank} (its process, which holds the group's store, no longer answers)"
                        for rank, pid in dead)
        said = f" torch said: {_first_line(exc)}" if exc is not None else ""
        return (f"{who} died during {what}: its process ended, so this rank ({self.me}) builds no more with it "
                f"(look in that rank's log for why it ended); what was sealed stays, and the next start "
                f"resumes it.{said}")


_PEER_KEY = "hostmem/shared-build/process/"


def _pid_space() -> int | None:
    """This process's pid namespace (its inode): ranks in the same one see each other's pids."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


class PeerWatch(RankWatch):
    """A :class:`RankWatch` that learns the host's ranks from the group's store: this rank
    publishes ``(host, pid, start time)`` there when it is made, before any gather, and
    reads the others' as they appear, so that a rank that dies before the first exchange
    is named too. :meth:`check` is what a watched gather calls while it waits."""

    def __init__(self, dist):
        from hostmem.host_ledger import group_store

        super().__init__([], dist.get_rank())
        self._store, self._host = group_store(dist), socket.gethostname()
        self._pending = [rank for rank in range(dist.get_world_size()) if rank != self.me]
        try:
            if self._store is not None:
                self._store.set(f"{_PEER_KEY}{self.me}", json.dumps([self._host, _pid_space(), *this_process()]))
        except RuntimeError:
            pass  # the store is gone already (its rank died): the first gather fails, and names it

    def learn(self) -> None:
        """Note the processes of the ranks that have published theirs since the last look."""
        for rank in list(self._pending) if self._store is not None else []:
            key = f"{_PEER_KEY}{rank}"
            if not self._store.check([key]):
                continue
            self._pending.remove(rank)
            host, space, pid, started = json.loads(self._store.get(key))
            if space is not None and (host, space) == (self._host, _pid_space()) and started is not None:  # pids we see
                self.processes[rank] = (pid, started)  # judged even where it has ended by now

    def dead(self) -> list[tuple[int, int | None]]:
        """The watched ranks whose process has ended; and rank 0, where the group's store it
        holds no longer answers (its pid where it was published: None where it was not)."""
        found = super().dead()
        if not found and self.me != 0 and self._store is not None and 0 not in self.processes:
            try:
                self._store.check([f"{_PEER_KEY}{self.me}"])
            except RuntimeError:
                found = [(0, None)]
        return found

    def check(self, what: str = "a shared LoRA merge build") -> None:
        """Raise :class:`RankDiedError` naming the ranks of this host whose process has ended."""
        try:
            self.learn()
        except RuntimeError:
            pass  # the store is gone (its rank died): the gather's own error says so, and is named then
        dead = self.dead()
        if dead:
            raise RankDiedError(self.message(dead, what, None))


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
