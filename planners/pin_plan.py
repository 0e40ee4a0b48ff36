"""The pin plan: which streamed layers and which text-encoder bytes get pinned.

Pinned bytes go where they save the most transfer time per byte. A streamed layer
moves ``steps x passes_per_step`` times per request, a fully offloaded component
(a text encoder) once, so candidates are ordered by moves per request: every
streamed layer comes before any text-encoder byte, and a text encoder gets what is
left, whole layers only (first fit: a leftover too small for the next layer may
still take a smaller one further on).

A pin is charged its net cost: pinning a layer in place (mlock, cudaHostRegister)
turns its page-cache bytes into locked bytes and makes no copy, so it costs the
layer's reclaimable bytes, and bytes already anonymous cost nothing more.

The page cache must still hold the unpinned layers. What is left of the budget's
room after pins is given to unpinned layers in the same order; a component whose
layers do not fit is read from disk on every move, and so is everything after it
(a cyclic stream larger than the cache evicts each page before its reuse). The
plan is the prefix of the greedy selection with the least transfer time per
request, so it pins less when pinning more would push streamed layers to disk.

Where the unpinned layers cannot all stay in page cache, the executor streams some of
them through a read-ahead window (:func:`planners.layer_roles.window_bytes`): pins
stop short of that window's room, or every streamed layer would be read twice (evicted
while read ahead, read again when used). Where everything fits, no window is needed.
"""

from __future__ import annotations

from typing import NamedTuple

from hostmem.units import format_size

from .budget import HostBudget
from .layer_roles import window_bytes
from .sizes import REST, Layer

__all__ = ["CostModel", "MoveGroup", "PinPlan", "PinPlans", "plan_pins", "thrash_line", "turns_line"]


class CostModel(NamedTuple):
    """Transfer rates in bytes per second."""

    pinned_h2d: float
    pageable_h2d: float
    disk_read: float

    def seconds(self, pinned: int, pageable: int, from_disk: int) -> float:
        """One move: pinned bytes at pinned speed; pageable ones copied, after a disk read for misses."""
        return pinned / self.pinned_h2d + pageable / self.pageable_h2d + from_disk / self.disk_read


class MoveGroup(NamedTuple):
    """The units of one component that move ``moves`` times per request."""

    component: str
    units: tuple[Layer, ...]
    moves: int
    alternates: tuple[str, ...] = ()  # experts taking turns with this one (itself included): one page cache


class PinPlan(NamedTuple):
    """One component's pins and the transfer time they buy, per request."""

    component: str
    moves_per_request: int
    candidate_layers: int
    pinned_layers: tuple[str, ...]
    pinned_bytes: int
    net_cost_bytes: int
    page_cache_bytes: int  # unpinned bytes that must stay in page cache
    page_cache_fits: bool
    disk_bytes_per_request: int
    transfer_s_per_request: float
    baseline_transfer_s_per_request: float
    kept_layers: tuple[str, ...] = ()  # the executor's kept set (planners.layer_roles), set by the planner
    alternates: tuple[str, ...] = ()  # the experts it takes turns with, sharing the page cache
    disk_once: bool = False  # its disk bytes are read once per request (its turn), not on every move
    rest_candidate: bool = False  # the tensors outside every block are one of the candidates (REST)


class PinPlans(NamedTuple):
    """The pin plans of all components, and what the budget had to say."""

    plans: dict[str, PinPlan]
    budget_bytes: int
    room_after_pins: int
    allowed_layers: int  # layers the budget alone would pin
    warnings: tuple[str, ...]
    notes: tuple[str, ...] = ()  # facts of the host no setting changes (weights larger than it)
    prefetch: int = 0  # layers read ahead: the executor's default, so that it keeps what the plan says
    window_bytes: int = 0  # room the pins left for the read-ahead window (0: every layer fits)

    @property
    def pinned_bytes(self) -> int:
        return sum(p.pinned_bytes for p in self.plans.values())

    @property
    def net_cost_bytes(self) -> int:
        return sum(p.net_cost_bytes for p in self.plans.values())

    @property
    def transfer_s_per_request(self) -> float:
        return sum(p.transfer_s_per_request for p in self.plans.values())

    @property
    def baseline_transfer_s_per_request(self) -> float:
        return sum(p.baseline_transfer_s_per_request for p in self.plans.values())


def _window(groups: list[MoveGroup], budget: HostBudget, prefetch: int) -> int:
    """The read-ahead window the pins must leave free: none where every unit fits in the room,
    else the largest any group streams through (its layers before pins: never less than after)."""
    if sum(u.reclaimable for g in groups for u in g.units) <= budget.room:
        return 0
    return max((window_bytes([u.reclaimable for u in g.units if u.name != REST], prefetch) for g in groups),
               default=0)


def _greedy(groups: list[MoveGroup], budget: HostBudget, window: int) -> list[tuple[int, Layer]]:
    """Units the budget can pay for, in priority order, leaving ``window`` bytes of the room:
    ``(group index, unit)``."""
    if budget.bytes == 0:
        return []
    chosen, net, gross = [], 0, 0
    for g, group in enumerate(groups):
        for unit in group.units:
            cap_cost = unit.nbytes - unit.residency.pinned
            if net + unit.reclaimable <= budget.room - window and gross + cap_cost <= budget.pin_cap:
                chosen.append((g, unit))
                net, gross = net + unit.reclaimable, gross + cap_cost
    return chosen


class _Outcome(NamedTuple):
    seconds: tuple[float, ...]
    from_disk: tuple[int, ...]
    fits: tuple[bool, ...]
    room_after_pins: int
    once: tuple[bool, ...] = ()  # per group: disk read once per request (an expert's turn)


def _turns(needs: list[int], room: int) -> list[int]:
    """Disk bytes per request of experts that take turns in one page cache too small for all.

    During an expert's turn the cache holds it whole (it fits alone) and what is left of
    the others: ``room - need``. So of expert ``i`` at most ``room - (the others' needs)``
    survives the others' turns, and the rest is read back once, at the start of its turn.
    """
    total = sum(needs)
    return [need - min(need, max(0, room - (total - need))) for need in needs]


def _evaluate(groups, totals, pinned_bytes, pinned_need, net_cost, budget, cost) -> _Outcome:
    """Transfer time per request of each group for one choice of pins.

    Groups get the room in order; experts that take turns get it together, at the first
    of them: all of them fit, or each that fits alone reads back per request what the
    others' turns evicted (:func:`_turns`), and one that does not fit alone thrashes.
    """
    room = budget.room - net_cost
    n = len(groups)
    seconds, disk, fits, once = [0.0] * n, [0] * n, [False] * n, [False] * n
    thrashing, done = False, set()
    for g, group in enumerate(groups):
        if g in done:
            continue
        members = [g] if not group.alternates else [i for i in range(n) if groups[i].alternates == group.alternates]
        done.update(members)
        needs = [totals[i][1] - pinned_need[i] for i in members]
        together = not thrashing and sum(needs) <= room
        turns = _turns(needs, room) if not together and not thrashing and len(members) > 1 else [None] * len(members)
        for i, need, turn in zip(members, needs, turns):
            pageable = totals[i][0] - pinned_bytes[i]
            moves = groups[i].moves
            if together:
                missed = 0
            elif turn is not None and need <= room:
                missed, once[i] = turn, True
            else:
                missed = moves * need
            seconds[i] = moves * cost.seconds(pinned_bytes[i], pageable, 0) + missed / cost.disk_read
            disk[i], fits[i] = missed, together
        room -= sum(needs) if together else 0
        thrashing = thrashing or not together
    return _Outcome(tuple(seconds), tuple(disk), tuple(fits), budget.room - net_cost, tuple(once))


def plan_pins(groups: list[MoveGroup], budget: HostBudget, cost: CostModel, prefetch: int = 0) -> PinPlans:
    """Pin plans for ``groups`` under ``budget``, by the cost model ``cost``, leaving room for
    a read-ahead window of ``prefetch`` layers where the layers do not all fit."""
    groups = sorted(groups, key=lambda g: -g.moves)  # stable: config order among equals
    totals = [(sum(u.nbytes for u in g.units), sum(u.reclaimable for u in g.units)) for g in groups]
    window = _window(groups, budget, prefetch)
    chosen = _greedy(groups, budget, window)
    pinned_bytes, pinned_need, net = [0] * len(groups), [0] * len(groups), 0
    outcomes = [_evaluate(groups, totals, pinned_bytes, pinned_need, net, budget, cost)]
    for g, unit in chosen:
        pinned_bytes[g] += unit.nbytes
        pinned_need[g] += unit.reclaimable
        net += unit.reclaimable
        outcomes.append(_evaluate(groups, totals, pinned_bytes, pinned_need, net, budget, cost))
    best = min(range(len(outcomes)), key=lambda p: (round(sum(outcomes[p].seconds), 9), p))
    return _assemble(groups, chosen, best, outcomes, budget)._replace(prefetch=prefetch, window_bytes=window)


def _assemble(groups, chosen, best, outcomes, budget) -> PinPlans:
    taken = chosen[:best]
    outcome, baseline = outcomes[best], outcomes[0]
    plans = {}
    for g, group in enumerate(groups):
        mine = [u for gi, u in taken if gi == g]
        unpinned_need = sum(u.reclaimable for u in group.units) - sum(u.reclaimable for u in mine)
        plans[group.component] = PinPlan(
            component=group.component,
            moves_per_request=group.moves,
            candidate_layers=len(group.units),
            rest_candidate=any(u.name == REST for u in group.units),
            pinned_layers=tuple(u.name for u in mine),
            pinned_bytes=sum(u.nbytes for u in mine),
            net_cost_bytes=sum(u.reclaimable for u in mine),
            page_cache_bytes=unpinned_need,
            page_cache_fits=outcome.fits[g],
            disk_bytes_per_request=outcome.from_disk[g],
            transfer_s_per_request=outcome.seconds[g],
            baseline_transfer_s_per_request=baseline.seconds[g],
            alternates=group.alternates,
            disk_once=outcome.once[g],
        )
    warnings, notes = _warnings(groups, plans, outcome, budget, len(chosen), best, outcomes)
    return PinPlans(plans, budget.bytes, outcome.room_after_pins, len(chosen), tuple(warnings), tuple(notes))


def thrash_line(plan: PinPlan, budget, roles=None) -> tuple[str, bool]:
    """The page-cache thrash line, and whether it is a warning (something in the deployment to change).

    With committed non-reclaimable memory, giving it back makes room for page cache:
    that is advice. With none, the streamed weights are simply larger than what the
    host holds next to the pins the planner judged worth it: a fact of the host, shown
    beside the pin plans, which only a larger host or more VRAM changes. ``roles`` (the
    executor's, :mod:`planners.layer_roles`) says how many blocks it keeps in page cache.
    """
    kept = (f"; the executor keeps {len(roles.kept)} of {len(roles.kept) + len(roles.released)} in page cache "
            "and reads the others on every move") if roles is not None else ""
    head = (f"{plan.component} reads {format_size(plan.disk_bytes_per_request)} from disk per request: its "
            f"unpinned blocks need {format_size(plan.page_cache_bytes)} of page cache, more than the host holds "
            f"next to the pins and the blocks before it{kept}")
    if budget.committed > 0:
        return (f"page-cache thrash: {head}. Give back the {format_size(budget.committed)} of committed "
                "non-reclaimable memory (map weights read-only, merge LoRAs through the cache), raise "
                "host.limit or keep more blocks on the device"), True
    return f"{head} (nothing is committed to give back: only a larger host or more VRAM avoids it)", False


def turns_line(plan: PinPlan, plans, budget) -> tuple[str, bool]:
    """The line of an expert whose turn reads back what the other experts' turns evicted."""
    others = [plans[n] for n in plan.alternates if n != plan.component and n in plans]
    need = plan.page_cache_bytes + sum(p.page_cache_bytes for p in others)
    head = (f"{plan.component} reads {format_size(plan.disk_bytes_per_request)} from disk per request, once at the "
            f"start of its turn: it takes turns with {', '.join(p.component for p in others)}, and their unpinned "
            f"blocks together need {format_size(need)} of page cache, more than the host holds next to the pins")
    if budget.committed > 0:
        return (f"page-cache thrash: {head}. Give back the {format_size(budget.committed)} of committed "
                "non-reclaimable memory, raise host.limit or keep more blocks on the device"), True
    return f"{head} (nothing is committed to give back: only a larger host or more VRAM avoids it)", False


def _warnings(groups, plans, outcome, budget, allowed, best, outcomes) -> tuple[list[str], list[str]]:
    out, notes = [], []
    for group in groups:
        plan = plans[group.component]
        if not plan.page_cache_fits and plan.page_cache_bytes:
            line, is_warning = turns_line(plan, plans, budget) if plan.disk_once else thrash_line(plan, budget)
            (out if is_warning else notes).append(line)
    if best < allowed:
        saved = sum(outcomes[allowed].seconds) - sum(outcomes[best].seconds)
        out.append(
            f"pinned {best} of the {allowed} blocks the budget allows: pinning the rest would leave too "
            f"little page cache for the streamed blocks and cost {saved:.2f} s more per request"
        )
    return out, notes
