"""One host budget for every rank on a host, split across the local ranks.

Each rank of a multi-GPU server that plans alone sizes its pins against the whole
host, so together they pin N times what the host can give. The host budget is
computed once per host instead::

    host budget = limit - local ranks x reserve - the ranks' committed memory
                  - what the ranks hold back for pending adapter builds
                  (floored at 0), capped by max_pinned less what they already pinned

The reserve is per rank (each has its own Python, CUDA context and activations);
committed memory is each rank's non-reclaimable memory, summed (pages the ranks
share are file-backed, so they commit nothing). The budget is split by need, a
rank's need being the bytes it could pin (its streamed layers and fully offloaded
components): a host budget that covers every need gives each rank its need; one
that does not gives each rank ``budget x need / sum of needs``, rounded down; ranks
that need nothing get nothing. The shares never sum to more than the host budget,
and each rank's pin plan is made under its share.

The local ranks come from the process group where torch.distributed is
initialised (ranks on this host found by hostname, their needs gathered);
otherwise from what torchrun sets (``LOCAL_WORLD_SIZE``, ``LOCAL_RANK``): the
ranks are then taken to be alike (same model, same plan) and the shares are equal.
The report says which.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Mapping, Sequence

from hostmem.errors import InputError
from hostmem.residency_classes import Residency
from hostmem.units import format_size

from .budget import HostLimit, host_budget
from .config import DeploymentConfig
from .config.parallel import local_world as config_local_world

__all__ = ["RankNeed", "HostShare", "split_host_budget", "host_budget_of", "local_world", "share_for", "rank_need",
           "capped_config", "host_reasons", "rank_limit"]


@dataclass(frozen=True)
class RankNeed:
    """What one rank brings to the host budget: what it could pin and what it commits."""

    need: int  # bytes it could pin: streamed layers and fully offloaded components
    committed: Residency  # its non-reclaimable memory (anonymous, shmem, pinned)
    process_excess: int = 0
    build_reserve: int = 0  # held back for its pending adapter builds


@dataclass(frozen=True)
class HostShare:
    """This rank's part of the host budget, and where the local ranks came from."""

    local_rank: int
    local_world_size: int
    source: str  # "process group" or "LOCAL_WORLD_SIZE (no process group)"
    host_budget: int
    shares: tuple[int, ...]
    needs: tuple[int, ...]
    host_committed: int = 0  # what the local ranks commit together (anonymous, shmem, pinned, excess, builds)
    host_reserve: int = 0  # the config's reserve, once per local rank

    @property
    def share(self) -> int:
        return self.shares[self.local_rank]

    def to_dict(self) -> dict:
        return {"local_rank": self.local_rank, "local_world_size": self.local_world_size, "source": self.source,
                "host_budget_bytes": self.host_budget, "share_bytes": self.share, "shares_bytes": list(self.shares),
                "needs_bytes": list(self.needs)}


def split_host_budget(budget: int, needs: Sequence[int]) -> list[int]:
    """Shares of ``budget`` by need (see the module): each at most its need, summing to at most ``budget``."""
    if budget < 0 or any(n < 0 for n in needs):
        raise InputError(f"split_host_budget: budget {budget} and needs {list(needs)} must not be negative")
    total = sum(needs)
    if total <= budget:
        return list(needs)
    return [budget * n // total for n in needs]


def host_budget_of(config: DeploymentConfig, limit: int, ranks: Sequence[RankNeed]) -> int:
    """The host budget of ``ranks`` under ``limit`` (the formula of the module)."""
    committed = sum((r.committed for r in ranks), Residency())
    excess = sum(r.process_excess for r in ranks)
    reserve = min(limit, config.host.reserve * len(ranks))
    builds = sum(r.build_reserve for r in ranks)
    return host_budget(limit, reserve, config.host.max_pinned(limit), committed, excess, builds).bytes


def local_world(environ: Mapping[str, str] = os.environ) -> tuple[int, int] | None:
    """``(LOCAL_RANK, LOCAL_WORLD_SIZE)`` as torchrun sets them, or None when absent."""
    return config_local_world(environ)


def _process_group_active() -> bool:
    dist = sys.modules.get("torch.distributed")  # never imported: no group can exist
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def share_for(config: DeploymentConfig, limit: int, mine: RankNeed, *, group=None,
              environ: Mapping[str, str] = os.environ, timeout: float = 60.0) -> HostShare | None:
    """This rank's :class:`HostShare`, or None when it is alone on its host.

    With a process group this is a collective (every rank calls it); without one it
    reads torchrun's variables and assumes the local ranks are like this one.
    """
    if _process_group_active():
        from hostmem.host_ledger import gather_on_host

        import torch.distributed as dist

        entries = gather_on_host(mine, group=group, timeout=timeout, what="split the host budget")
        ranks = [need for _, need in entries]
        local_rank = [rank for rank, _ in entries].index(dist.get_rank())
        source = "process group"
    else:
        found = local_world(environ)
        if found is None:
            return None
        local_rank, size = found
        ranks, source = [mine] * size, "LOCAL_WORLD_SIZE (no process group)"
    if len(ranks) < 2:
        return None
    budget = host_budget_of(config, limit, ranks)
    needs = [r.need for r in ranks]
    committed = sum(r.committed.non_reclaimable + r.process_excess + r.build_reserve for r in ranks)
    return HostShare(local_rank, len(ranks), source, budget, tuple(split_host_budget(budget, needs)), tuple(needs),
                     committed, config.host.reserve * len(ranks))


def host_reasons(share: HostShare, limit: int) -> list[str]:
    """Why the local ranks together overrun the host's ``limit`` (empty when they do not):
    a rank's own verdict measures it alone against the whole host."""
    n, c, r = share.local_world_size, share.host_committed, share.host_reserve
    said = (f"committed by the {n} ranks on this host {format_size(c)} + reserve {n} x "
            f"{format_size(r // n)} = {format_size(r)}")
    if c > limit:
        return [f"{said}: the committed part alone > host limit {format_size(limit)}: killed while loading"]
    if c + r > limit:
        return [f"{said} > host limit {format_size(limit)}: killed at the first request"]
    return []


def rank_limit(share: HostShare, host: HostLimit, mine: RankNeed) -> HostLimit:
    """``host`` with this rank's part of its limit: its own reserve, what it commits, its
    share of the pins, and an equal part of the page cache room the ranks leave together.
    Its room (pins + page cache) then is its part of the host's, where planned against the
    whole limit it took the room every rank counts on; for alike ranks the part is
    ``limit / ranks``, as ``hostmem plan --ranks N`` plans one."""
    n = share.local_world_size
    own = mine.committed.non_reclaimable + mine.process_excess + mine.build_reserve
    room = max(0, host.bytes - share.host_reserve - share.host_committed - sum(share.shares))
    part = min(host.bytes, share.host_reserve // n + own + share.share + room // n)
    return host._replace(bytes=part, source=f"this rank's part of {format_size(host.bytes)} ({host.source}) for the "
                                            f"{n} ranks on this host")


def capped_config(config: DeploymentConfig, share: HostShare, committed_pinned: int) -> DeploymentConfig:
    """``config`` with this rank's pins capped at its share (max_pinned = pinned already + share)."""
    host = config.host._replace(max_pinned_bytes=committed_pinned + share.share, max_pinned_fraction=None,
                                max_pinned_from=f"this rank's share of the pins the {share.local_world_size} ranks "
                                                "on this host may make together")
    return config._replace(host=host)


def rank_need(plan) -> RankNeed:
    """What a rank's plan (``DeploymentPlan``) could pin and what it commits."""
    b = plan.budget
    full = sum(s.weights_bytes for s in plan.components.values() if s.offload == "full")
    committed = Residency(anonymous=b.committed_anonymous, shmem=b.committed_shmem, pinned=b.committed_pinned)
    return RankNeed(plan.device.streamed_bytes + full, committed, b.process_excess, b.build_reserve)
