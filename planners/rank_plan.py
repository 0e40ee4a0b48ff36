"""The ranks of one host, planned before loading: what one rank holds, and its share.

A host running ``parallel.ranks`` processes (one per GPU; ``hostmem plan --ranks N``,
torchrun's ``LOCAL_WORLD_SIZE``) plans one rank, the ranks being alike:

- each rank holds ``1 / tensor_parallel`` of every component in ``parallel.split`` (its
  tensor-parallel part) and a whole copy of every other component;
- the host's limit and its pin cap are divided among the ranks, and each rank keeps a
  whole reserve (its own Python, CUDA context and activations), so the host budget is
  ``limit - ranks x (reserve + a rank's committed memory)``, capped by ``max_pinned``,
  and each rank's share is ``1 / ranks`` of it, as :mod:`planners.host_share` splits a
  live host's budget among alike ranks;
- a component every rank maps from one file shares its page cache across the ranks;
  the plan counts it in each rank's page cache, which errs on the side of disk reads.

The verdict is the host's: every rank's committed memory and reserve against the limit.
"""

from __future__ import annotations

from typing import Mapping

from hostmem.residency_classes import CLASSES, Residency

from .config import DeploymentConfig
from .sizes import ComponentSizes, Layer

__all__ = ["rank_components", "rank_share", "split_sizes"]


def _split_residency(residency: Residency, parts: int, nbytes: int) -> Residency:
    values = {c: getattr(residency, c) // parts for c in CLASSES}
    largest = max(CLASSES, key=lambda c: values[c])
    values[largest] += nbytes - sum(values.values())  # what the floors left, so the classes sum to nbytes
    return Residency(**values)


def split_sizes(sizes: ComponentSizes, parts: int) -> ComponentSizes:
    """One tensor-parallel part of ``sizes``: every unit ``1 / parts`` of its bytes (rounded down)."""
    if parts == 1:
        return sizes

    def part(unit: Layer) -> Layer:
        nbytes = unit.nbytes // parts
        return unit._replace(nbytes=nbytes, residency=_split_residency(unit.residency, parts, nbytes),
                             lora_target_bytes=unit.lora_target_bytes // parts)

    return sizes.with_units(part(u) for u in sizes.units)._replace(extra=_split_residency(
        sizes.extra, parts, sizes.extra.total // parts))


def rank_components(config: DeploymentConfig, sizes: Mapping[str, ComponentSizes]) -> dict[str, ComponentSizes]:
    """What one rank holds: its part of every split component, every other one whole."""
    p = config.parallel
    return {name: split_sizes(s, p.tensor_parallel) if name in p.split else s for name, s in sizes.items()}


def rank_share(config: DeploymentConfig, plan, ranks: int) -> dict:
    """The rank's part of the host, in the form of a live ``HostShare.to_dict()`` and more:
    the host's budget and limit, each rank's reserve and committed memory, the parts' sizes."""
    from .host_share import rank_need, split_host_budget

    b = plan.budget
    need = rank_need(plan).need
    p = config.parallel
    shares = split_host_budget(b.bytes * ranks, [need] * ranks)  # by need, as live ranks split it
    local = p.local_rank if p.local_rank < ranks else 0
    return {
        "local_rank": local,
        "local_world_size": ranks,
        "source": f"{p.source}: ranks taken to be alike" if p.source != "default" else "config",
        "host_budget_bytes": b.bytes * ranks,
        "share_bytes": shares[local],
        "shares_bytes": shares,
        "needs_bytes": [need] * ranks,
        "host_limit_bytes": plan.host.bytes,
        "limit_per_rank_bytes": b.limit,
        "reserve_per_rank_bytes": b.reserve,
        "committed_per_rank_bytes": b.committed,
        "host_committed_bytes": b.committed * ranks,
        "host_reserve_bytes": b.reserve * ranks,
        "tensor_parallel": p.tensor_parallel,
        "parts_bytes": {name: plan.components[name].weights_bytes for name in p.split if name in plan.components},
    }
