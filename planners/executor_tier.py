"""The plan's disk tier as the executor runs it: what a request reads from disk.

The pin plan alone predicts the kernel's LRU: once the unpinned layers of a streamed
component do not fit in page cache, every one of them is read from disk on every
move. The executor keeps a fixed set that fits and reads only the rest
(:mod:`.roles`), so for a component with ``offload: layerwise`` the report's disk
figure, and the page-cache line that states it, are the executor's prediction: the
released layers' bytes times the moves per request. Transfer times and the other
figures stay the pin plan's. Every pin plan carries the executor's kept set
(``kept_layers``), the same :func:`.roles.plan_roles` output the executor runs by.
"""

from __future__ import annotations

from .pin_plan import thrash_line
from .layer_roles import plan_roles

__all__ = ["with_executor_disk"]


def with_executor_disk(plan: "DeploymentPlan", prefetch: int) -> "DeploymentPlan":
    """``plan`` with each component's kept set, and each layerwise component's disk bytes per
    request and its line, the executor's."""
    layerwise = {n for n, p in plan.pins.plans.items()
                 if n in plan.components and plan.components[n].offload == "layerwise" and not p.page_cache_fits
                 and not p.disk_once}  # experts taking turns: read back once per turn (planners.pin_plan)
    roles = plan_roles(plan, prefetch)
    plans = {n: p._replace(kept_layers=roles[n].kept) for n, p in plan.pins.plans.items()}
    if not layerwise:
        return plan._replace(pins=plan.pins._replace(plans=plans))
    swap = {}
    for name in layerwise:
        old = plans[name]
        new = old._replace(disk_bytes_per_request=roles[name].predicted_read_bytes * old.moves_per_request)
        plans[name] = new
        if old.page_cache_bytes:
            before, after = thrash_line(old, plan.budget)[0], thrash_line(new, plan.budget, roles[name])[0]
            swap[before] = after

    def redo(lines):
        return tuple(swap.get(line, line) for line in lines)

    pins = plan.pins._replace(plans=plans, warnings=redo(plan.pins.warnings), notes=redo(plan.pins.notes))
    return plan._replace(pins=pins, warnings=redo(plan.warnings))
