"""A deployment's plan: budget, device plan and pin plans from sizes (pure).

:func:`plan_deployment` takes a config and every component's sizes with their
residency (predicted before loading, measured after) and returns a
:class:`DeploymentPlan`. It reads nothing from the machine: the host limit comes in
resolved, so the same numbers always give the same plan.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

from hostmem.errors import InputError
from hostmem.residency_classes import Residency
from hostmem.units import format_size

from .budget import HostBudget, HostLimit, host_budget
from .config import DeploymentConfig
from .config.model import TransferConfig
from .device_plan import DevicePlan, Streamed, device_in_host_memory, plan_devices
from .pin_plan import CostModel, MoveGroup, PinPlans, plan_pins
from .providers import OfferRecord, apply_offer, collect_offers
from .sizes import ComponentSizes, missed_families, sum_residency
from .verdict import Verdict, device_digits, format_device, verdict

__all__ = ["AlternativePlan", "DeploymentPlan", "OfferOutcome", "plan_deployment", "cost_model"]


class OfferOutcome(NamedTuple):
    """A provider's offer and the plan it would give, next to the plan without it."""

    offer: OfferRecord
    budget_bytes: int
    pinned_bytes: int
    transfer_s_per_request: float
    fits: bool = True  # False: the plan with the offer is killed too, and serves no request
    applied_bytes: int | None = None  # what the offer takes off this plan's component (at most what it holds)


class AlternativePlan(NamedTuple):
    """The same deployment planned another way (without the LoRA merge cache), for comparison."""

    label: str
    merge: str
    budget_bytes: int
    committed_bytes: int
    pinned_bytes: int
    pinned_layers: Mapping[str, tuple[str, ...]]
    transfer_s_per_request: float
    over_limit_bytes: int = 0  # committed beyond the host limit: killed while it loads, without swap
    fits: bool = True  # the alternative's own verdict (planners.verdict)


class DeploymentPlan(NamedTuple):
    deployment: str
    mode: str  # "what-if" (before loading) or "live" (measured)
    merge: str
    host: HostLimit
    budget: HostBudget
    components: Mapping[str, ComponentSizes]
    device: DevicePlan
    pins: PinPlans
    offers: tuple[OfferOutcome, ...] = ()
    warnings: tuple[str, ...] = ()
    merge_reason: str = ""
    alternatives: tuple[AlternativePlan, ...] = ()
    lora_merge: Mapping | None = None  # what lora_cache.merge did (MergeStats.to_dict()), live plans
    host_share: Mapping | None = None  # this rank's part of the host budget (HostShare.to_dict()), live plans
    verdict: Verdict = Verdict(True, 0, ())  # whether it fits, and why not (planners.verdict)
    transfer: TransferConfig | None = None  # the rates planned with, and their source

    @property
    def fits(self) -> bool:
        return self.verdict.fits


def cost_model(config: DeploymentConfig) -> CostModel:
    t = config.transfer
    return CostModel(pinned_h2d=t.pinned_h2d, pageable_h2d=t.pageable_h2d, disk_read=t.disk_read)


def _committed(components: Mapping[str, ComponentSizes]) -> Residency:
    return sum_residency(sizes.residency for sizes in components.values())


def _move_groups(config: DeploymentConfig, components, device: DevicePlan) -> list[MoveGroup]:
    groups = []
    turns = config.alternating()
    for name, sizes in components.items():
        if sizes.offload == "layerwise":
            streamed = set(device.part(name).streamed_layers)
            units = tuple(u for u in sizes.units if u.name in streamed)
            groups.append(MoveGroup(name, units, config.moves(name), turns if name in turns else ()))
        elif sizes.offload == "full":
            groups.append(MoveGroup(name, sizes.units, 1))
    return groups


def plan_device_memory(config: DeploymentConfig, components: Mapping[str, ComponentSizes]) -> DevicePlan:
    """Every component's device memory (:mod:`planners.device_plan`): streamed ones with
    their windows, ``full`` ones in flight, ``none`` ones held whole. What a ``none`` or
    ``full`` component has on a device already (``device_bytes``: a text encoder the
    server moved there) counts there too; a streamed one's are left to its executor,
    which places its layers as this plan says."""
    streamed = [Streamed(components[c.name], c.prefetch, config.moves(c.name)) for c in config.streamed_components]
    held = {n: s.weights_bytes + s.device_bytes for n, s in components.items() if s.offload == "none"}
    in_flight = {n: s.weights_bytes + s.device_bytes for n, s in components.items() if s.offload == "full"}
    return plan_devices(streamed, held, in_flight, config.device.vram, config.device.reserve)


def _prefetch(config: DeploymentConfig) -> int:
    """The read-ahead depth the pins leave room for: the deepest of the streamed components'."""
    return max((c.prefetch for c in config.streamed_components), default=0)


def _core(config, components, host: HostLimit, process_excess: int, build_reserve: int = 0, ranks: int = 1):
    """Budget, device plan and pin plans; with ``ranks`` above 1, one rank's: a ``1/ranks``
    part of the host's limit and of its pin cap, with a whole reserve (:mod:`planners.rank_plan`)."""
    device = plan_device_memory(config, components)
    limit = host.bytes // ranks
    budget = host_budget(
        limit, config.host.reserve, config.host.max_pinned(host.bytes) // ranks, _committed(components),
        process_excess, build_reserve, config.host.reserve_source,
        device_in_host_memory(device) if host.is_unified else 0,
    )
    pins = plan_pins(_move_groups(config, components, device), budget, cost_model(config), _prefetch(config))
    return budget, device, _as_run(config, host, components, budget, device, pins)


def _as_run(config, host, components, budget, device, pins: PinPlans) -> PinPlans:
    """``pins`` with the executor's disk figures (:mod:`planners.executor_tier`), each time
    priced at them: every plan (this one, each offer's, each alternative's) alike."""
    from .executor_tier import with_executor_disk

    bare = DeploymentPlan(config.deployment, "what-if", "none", host, budget, components, device, pins,
                          transfer=config.transfer)
    return priced_by_disk(with_executor_disk(bare, _prefetch(config)), bare).pins


def _check_components(config: DeploymentConfig, components: Mapping[str, ComponentSizes]) -> None:
    missing = [name for name in config.components if name not in components]
    if missing:
        raise InputError(
            f"{config.origin.path}: components {', '.join(missing)} are in the config but were not given "
            "to the planner; pass every configured component (or remove it from the config)"
        )


def plan_deployment(
    config: DeploymentConfig,
    components: Mapping[str, ComponentSizes],
    host: HostLimit,
    *,
    mode: str = "what-if",
    merge: str = "none",
    process_excess: int = 0,
    build_reserve: int = 0,
    providers=(),
    notes: tuple[str, ...] = (),
    merge_reason: str = "",
    alternatives=(),
    lora_merge: Mapping | None = None,
    ranks: int = 1,
) -> DeploymentPlan:
    """Plan ``config`` over ``components`` on a host limited to ``host``.

    ``process_excess`` is anonymous memory of the serving process beyond the
    reserve that no weight explains (live plans); ``build_reserve`` is held back for
    pending adapter builds (:mod:`planners.budget`); ``providers`` are asked for
    offers, and each offer is planned next to the plan without it; ``notes`` are
    warnings found outside (a cache root on tmpfs) to report with the plan's own.
    ``alternatives`` are ``(label, merge, components)``: the same deployment with
    other residency (the in-place merge next to the cached one), planned beside it.
    ``merge_reason`` and ``lora_merge`` (what the merge did) are reported as given.
    ``ranks`` above 1 plans one of that many alike ranks on the host (``components`` are
    what one rank holds: :func:`planners.rank_plan.rank_components`), with the verdict
    for the host as a whole and the rank's share in ``host_share``.
    """
    _check_components(config, components)
    components = dict(components)
    budget, device, pins = _core(config, components, host, process_excess, build_reserve, ranks)
    outcomes = []
    for record in collect_offers(providers, set(components)):
        before = components[record.component]
        after = apply_offer(before, record)
        changed = {**components, record.component: after}
        b, d, p = _core(config, changed, host, process_excess, build_reserve, ranks)
        applied = before.residency.anonymous - after.residency.anonymous
        outcomes.append(OfferOutcome(record, b.bytes, p.pinned_bytes, p.transfer_s_per_request, verdict(b, d, ranks).fits,
                                     applied))
    others = []
    for label, other_merge, other in alternatives:
        _check_components(config, other)
        b, d, p = _core(config, dict(other), host, process_excess, build_reserve, ranks)
        layers = {name: tuple(plan.pinned_layers) for name, plan in p.plans.items()}
        other_verdict = verdict(b, d, ranks)
        others.append(AlternativePlan(label, other_merge, b.bytes, b.committed, p.pinned_bytes, layers,
                                      p.transfer_s_per_request, other_verdict.over_limit_bytes, other_verdict.fits))
    warnings = list(notes) + _host_warnings(host, budget, device, merge, config, components) + list(pins.warnings)
    plan = DeploymentPlan(
        deployment=config.deployment,
        mode=mode,
        merge=merge,
        host=host,
        budget=budget,
        components=components,
        device=device,
        pins=pins,
        offers=tuple(outcomes),
        warnings=tuple(warnings),
        merge_reason=merge_reason,
        alternatives=tuple(others),
        lora_merge=None if lora_merge is None else dict(lora_merge),
        verdict=verdict(budget, device, ranks),
        transfer=config.transfer,
    )
    if ranks > 1:
        from .rank_plan import rank_share

        plan = plan._replace(host_share=rank_share(config, plan, ranks))
    return plan


def priced_by_disk(plan: DeploymentPlan, before: DeploymentPlan) -> DeploymentPlan:
    """``plan`` with each pin plan's time per request priced at the disk bytes it says it reads.

    The executor's disk tier (:mod:`planners.executor_tier`) replaces the pin plan's disk
    figure (what the kernel's LRU would read) with what the executor reads; the time per
    request must be the time of those bytes, not of the LRU's: one source for both figures.
    """
    rate = plan.transfer.disk_read if plan.transfer is not None else None
    if rate is None:
        return plan
    plans = dict(plan.pins.plans)
    for name, p in plans.items():
        old = before.pins.plans[name].disk_bytes_per_request
        if p.disk_bytes_per_request != old:
            plans[name] = p._replace(
                transfer_s_per_request=p.transfer_s_per_request + (p.disk_bytes_per_request - old) / rate)
    return plan._replace(pins=plan.pins._replace(plans=plans))


# A machine sold as 32 GiB reports 31.2-31.6 GiB of MemTotal (firmware and the kernel keep
# the rest); a limit that names the machine's nominal size is not larger than the machine.
_MEMTOTAL_SHORTFALL = 0.04


def _budget_advice(budget: HostBudget, merge: str) -> str:
    """What would give the budget back, for this plan: never advice it already follows."""
    if budget.committed == 0:
        return "lower host.reserve or raise host.limit"
    if merge == "in-place":
        return "merge the LoRA through the cache (--what-if cached), map weights read-only, or raise host.limit"
    return "turn anonymous weights back into mapped ones (load them read-only, not copied) or raise host.limit"


def _zero_budget_line(budget: HostBudget, merge: str, config: DeploymentConfig | None) -> str:
    """Why the budget is 0, naming the cause: the room (committed + reserve reach the limit)
    or the pin cap (``max_pinned``, or pins already made up to it)."""
    if budget.room > 0 and budget.pin_cap == 0:
        shared = config.host.max_pinned_from if config is not None else ""
        if shared:
            return (f"host budget is 0: {shared} is {format_size(budget.max_pinned - budget.committed_pinned)}, "
                    "so nothing is pinned: the ranks together leave no room on the host (see the host share); "
                    "run fewer ranks on it, commit less in each, or raise host.limit")
        where = f" ({config.origin.where('host.max_pinned')})" if config is not None else ""
        if budget.max_pinned == 0:
            return (f"host budget is 0: host.max_pinned is 0{where}, so nothing is pinned although "
                    f"{format_size(budget.room)} is free; raise host.max_pinned (e.g. 75%) to pin")
        return (f"host budget is 0: {format_size(budget.committed_pinned)} is pinned already, all that "
                f"host.max_pinned ({format_size(budget.max_pinned)}{where}) allows; raise it to pin more")
    return (f"host budget is 0: committed non-reclaimable {format_size(budget.committed)} and the reserve "
            f"{format_size(budget.reserve)} reach the limit {format_size(budget.limit)}, so nothing is pinned: "
            f"{_budget_advice(budget, merge)}")


# Where the rest's tensor names are not known (declared sizes), a streamed component with more
# than this share of its bytes outside every block likely has a block pattern that misses a
# family of blocks (Flux's single_transformer_blocks). Where they are known (a checkpoint's
# headers, a live model), the families themselves are named, however small the share.
_REST_SHARE = 0.2


def _rest_warnings(components: Mapping[str, ComponentSizes], patterns: Mapping[str, tuple] | None = None) -> list[str]:
    out = []
    for name, sizes in components.items():
        rest = sizes.rest.nbytes if sizes.rest is not None else 0
        if sizes.offload != "layerwise" or not sizes.weights_bytes or not rest:
            continue
        if sizes.rest_families is not None:
            given = (patterns or {}).get(name, ())
            for family, blocks, nbytes in missed_families(sizes):
                narrower = [p for p in given if p != family and p.startswith(family)]
                fix = (f"replace {narrower[0]!r} with {family!r}" if narrower else f"add \"{family}\"")
                out.append(f"{format_size(nbytes)} of {name} ({nbytes / sizes.weights_bytes:.0%} of "
                           f"{format_size(sizes.weights_bytes)}) is {blocks} block(s) \"{family}\" that no layers "
                           f"pattern names: they fall into (rest) and never stream block by block; {fix} in "
                           f"components.{name}.layers")
        elif rest > _REST_SHARE * sizes.weights_bytes:
            out.append(
                f"{format_size(rest)} of {name} ({rest / sizes.weights_bytes:.0%} of {format_size(sizes.weights_bytes)}) "
                f"falls into (rest), outside every block: it never streams block by block. Its layers pattern "
                "likely misses a family of blocks; list every family, e.g. Flux's "
                "[\"transformer_blocks.{i}.\", \"single_transformer_blocks.{i}.\"]")
    return out


def _host_warnings(host: HostLimit, budget: HostBudget, device: DevicePlan, merge: str = "none",
                   config: DeploymentConfig | None = None, components=None) -> list[str]:
    out = []
    over = budget.committed - budget.limit
    if over > 0:
        out.append(
            f"committed non-reclaimable memory ({format_size(budget.committed)}) exceeds the host limit by "
            f"{format_size(over)}: without swap this deployment is killed while it loads"
        )
    if budget.bytes == 0:
        out.append(_zero_budget_line(budget, merge, config))
    configured = host.source not in ("MemTotal", "cgroup", "MemAvailable")
    if configured and host.bytes > host.machine_bytes * (1 + _MEMTOTAL_SHORTFALL):
        out.append(
            f"host limit {format_size(host.bytes)} is larger than this machine ({format_size(host.machine_bytes)}): "
            "right for planning another host, wrong for a server on this one"
        )
    if budget.process_excess:
        out.append(
            f"the process holds {format_size(budget.process_excess)} of anonymous memory beyond the reserve that "
            "no weight explains (a copied checkpoint, allocator caches); find it with hostmem inspect"
        )
    if not device.fits:
        name, _ = device.peak
        held = sorted(device.held, key=lambda item: -item[1])
        kept_alone = sum(b for _, b in held) > device.usable
        advice = ("what offload: none keeps there whole is more than it holds: "
                  + ", ".join(f"{n} ({format_device(b)})" for n, b in held)
                  + "; move it on only while it runs (offload: full) or block by block (offload: layerwise)"
                  if kept_alone else
                  "stream that component block by block (offload: layerwise), lower prefetch, or use a larger device")
        n = device_digits(device.vram, device.peak_bytes)
        out.append(
            f"device: the plan needs {format_device(device.peak_bytes, n)} of device memory at its peak"
            f"{f' (while {name} runs)' if name and not kept_alone else ''}, {format_device(device.shortfall)} more "
            f"than device.vram {format_device(device.vram, n)}: {advice}"
        )
    patterns = {} if config is None else {
        name: (c.layer_pattern,) if isinstance(c.layer_pattern, str) else tuple(c.layer_pattern or ())
        for name, c in config.components.items()}
    return out + _rest_warnings(components or {}, patterns)
