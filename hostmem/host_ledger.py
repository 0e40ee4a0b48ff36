"""Per-rank ledgers gathered over a torch.distributed process group, added up per host.

Every rank of a multi-GPU server accounts its own components; ranks on one host
that map the same merged-weight files hold those pages once between them, so the
host's figure is not the sum of the ranks'. :func:`gather_host_ledger` all-gathers
each rank's pid, ledger and storage ranges (gloo on the CPU will do), and the
lowest rank of each host measures the set of its ranks with shared pages counted
once (:mod:`hostmem.host_aggregate`), then hands the result to the others::

    ledger = hostmem.account({"dit": dit})
    host = hostmem.gather_host_ledger(ledger, components={"dit": dit})   # every rank calls it
    print(host.to_text())   # 4 ranks on gpu-07: dit 38.2 GiB in page cache once (4 x 38.2 GiB alone)

Ranks of one host are found by hostname. A rank that does not call in within
``timeout`` seconds fails every other rank with a :class:`HostGatherError` that names
it: each rank first marks its arrival in the process group's own store.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import re
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import HostmemError
from .host_aggregate import SetResidency, aggregate_ranges
from .units import format_size

__all__ = ["HostGatherError", "HostLedger", "gather_on_host", "gather_host_ledger", "group_store", "watching"]

# Calls per process group: collectives of one group happen in the same order on each of its ranks.
_CALLS: dict[str, itertools.count] = {}


class HostGatherError(HostmemError, RuntimeError):
    """Ranks that did not arrive at a host gather within its timeout (named in the message)."""

    def __init__(self, message: str, missing: tuple[int, ...] = ()):
        super().__init__(message)
        self.missing = missing


def _arrive(dist, group, timeout: float, what: str) -> None:
    """Mark this rank's arrival in the group's store and wait for every rank's mark."""
    ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
    name = getattr(group if group is not None else dist.group.WORLD, "group_name", "world")
    prefix = f"hostmem/arrived/{name}/{next(_CALLS.setdefault(name, itertools.count()))}/"
    store = group_store(dist)
    if store is None:  # no store to ask: torch's monitored barrier names them (on rank 0)
        _monitored_barrier(dist, group, timeout, what)
        return
    store.set(prefix + str(dist.get_rank()), "1")
    keys, deadline = [prefix + str(r) for r in ranks], time.monotonic() + timeout
    while True:
        try:
            store.wait(keys, datetime.timedelta(seconds=_wait_step(deadline)))
            return
        except RuntimeError as exc:  # torch's DistStoreError on timeout
            if _watch_between(store, keys, deadline):
                continue  # a short wait of a watched gather ran out: nobody has died, wait on
            missing = tuple(r for r in ranks if not store.check([prefix + str(r)]))
            raise HostGatherError(_missing_message(missing, timeout, what, exc), missing) from None


_WATCH = threading.local()  # what a gather calls while it waits, on this thread (see :func:`watching`)
_WATCH_EVERY = 0.25  # seconds between two calls


@contextlib.contextmanager
def watching(check):
    """Within: every gather of this thread calls ``check()`` every quarter of a second while
    it waits for the other ranks, so that a rank whose process has ended is named at once
    (``check`` raises) rather than once the gather's timeout runs out."""
    before, _WATCH.check = getattr(_WATCH, "check", None), check
    try:
        yield
    finally:
        _WATCH.check = before


def _wait_step(deadline: float) -> float:
    left = max(deadline - time.monotonic(), 0.001)
    return left if getattr(_WATCH, "check", None) is None else min(left, _WATCH_EVERY)


def _watch_between(store, keys: list[str], deadline: float) -> bool:
    """After a wait ran out: whether to wait again (a watch is set, time is left, and the
    store still answers). The watch raises where a rank has died."""
    check = getattr(_WATCH, "check", None)
    if check is None:
        return False
    check()
    if time.monotonic() >= deadline:
        return False
    store.check(keys[:1])  # the store is gone (its rank died): torch's error, for the watch's caller to name
    return True


def group_store(dist):
    """The default group's key-value store (every group of the process can reach it).

    torch hands it out only through a private getter; where that is gone, None.
    """
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except (RuntimeError, ValueError):
        return None


def _monitored_barrier(dist, group, timeout: float, what: str) -> None:
    try:
        dist.monitored_barrier(group, timeout=datetime.timedelta(seconds=timeout), wait_all_ranks=True)
    except RuntimeError as exc:
        found = re.search(r"Ranks? ([\d, ]+) failed", str(exc))
        missing = tuple(int(r) for r in found.group(1).split(",")) if found else ()
        raise HostGatherError(_missing_message(missing, timeout, what, exc), missing) from None


def _missing_message(missing: tuple[int, ...], timeout: float, what: str, exc: Exception) -> str:
    who = f"rank {', '.join(map(str, missing))}" if missing else "a rank (see rank 0's error)"
    return (
        f"{who} did not arrive within {timeout:g} s to {what} (rank {_rank()} waited): every rank must "
        f"make the same call; check that rank's log for an earlier error. torch: {_first_line(exc)}"
    )


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def gather_on_host(payload: Any, *, group=None, timeout: float = 60.0, what: str = "gather host figures"):
    """``[(rank, payload), ...]`` of every rank on this host, in rank order (a collective).

    Every rank of ``group`` (default: the world) must call it. A rank missing after
    ``timeout`` seconds fails the others with :class:`HostGatherError` naming it.
    """
    import torch.distributed as dist

    _arrive(dist, group, timeout, what)
    size = dist.get_world_size(group)
    gathered: list = [None] * size
    dist.all_gather_object(gathered, (socket.gethostname(), dist.get_rank(), payload), group=group)
    host = socket.gethostname()
    return [(rank, item) for name, rank, item in gathered if name == host]


@dataclass(frozen=True)
class HostLedger:
    """The ranks of one host: each rank's ledger, and the host's figures with shared pages once."""

    hostname: str
    ranks: tuple[int, ...]
    pids: Mapping[int, int]  # rank -> pid
    ledgers: Mapping[int, dict]  # rank -> Ledger.to_dict(parameters=False)
    processes: SetResidency  # every mapping of the ranks' processes
    components: Mapping[str, SetResidency]  # each component's storages across the ranks

    def to_dict(self) -> dict:
        """JSON-safe, bytes."""
        return {
            "hostname": self.hostname,
            "ranks": list(self.ranks),
            "pids": {str(r): p for r, p in self.pids.items()},
            "ledgers": {str(r): d for r, d in self.ledgers.items()},
            "processes": self.processes.to_dict(),
            "components": {name: s.to_dict() for name, s in self.components.items()},
        }

    def to_text(self) -> str:
        n = len(self.ranks)
        lines = [f"{n} ranks on {self.hostname} (precision: {self.processes.precision}):"]
        for name, s in self.components.items():
            t, alone = s.totals, s.summed
            lines.append(
                f"  {name}: {format_size(t.file_backed)} in page cache once ({n} ranks alone: "
                f"{format_size(alone.file_backed)}); non-reclaimable {format_size(t.non_reclaimable)} "
                f"(alone: {format_size(alone.non_reclaimable)})"
            )
        t, alone = self.processes.totals, self.processes.summed
        lines.append(
            f"  all memory of the {n} processes: non-reclaimable {format_size(t.non_reclaimable)}, file-backed "
            f"{format_size(t.file_backed)} once ({format_size(self.processes.shared_bytes)} shared between them)"
        )
        return "\n".join(lines)


def _storage_ranges(components) -> dict[str, list[tuple[int, int]]]:
    """Address ranges of every host storage of each component (shared storages once)."""
    from .accountant import _components, _unique_storages

    out: dict[str, list[tuple[int, int]]] = {}
    for s in _unique_storages(_components(components)):
        if s.device == "cpu" and s.nbytes:
            out.setdefault(s.component, []).append((s.start, s.start + s.nbytes))
    return out


def _measure(host: str, entries: list) -> HostLedger:
    """The host's figures from its ranks' pids and ranges (run on one rank per host)."""
    pids = {rank: item["pid"] for rank, item in entries}
    names = list(dict.fromkeys(n for _, item in entries for n in item["ranges"]))
    components = {
        name: aggregate_ranges({item["pid"]: item["ranges"].get(name, []) for _, item in entries})
        for name in names
    }
    from .host_aggregate import aggregate_processes

    return HostLedger(
        hostname=host,
        ranks=tuple(pids),
        pids=pids,
        ledgers={rank: item["ledger"] for rank, item in entries},
        processes=aggregate_processes(pids.values()),
        components=components,
    )


def gather_host_ledger(ledger, group=None, *, components: Mapping | None = None,
                       timeout: float = 60.0) -> HostLedger:
    """This host's :class:`HostLedger`, on every rank (a collective: every rank calls it).

    ``ledger`` is this rank's :func:`hostmem.account` result; ``components`` (the same
    ``{name: module}``) adds per-component figures with shared pages once. The lowest
    rank of each host reads /proc of its host's ranks; the others receive its result.
    """
    payload = {
        "pid": os.getpid(),
        "ledger": ledger.to_dict(parameters=False),
        "ranges": _storage_ranges(components) if components else {},
    }
    entries = gather_on_host(payload, group=group, timeout=timeout, what="gather the host ledger")
    measured = _measure(socket.gethostname(), entries) if entries[0][0] == _rank() else None
    results = gather_on_host(measured, group=group, timeout=timeout, what="share the host ledger")
    return next(item for _, item in results if item is not None)
