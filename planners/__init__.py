"""planners: a deployment's config in, its host budget, device and pin plans out.

What a server needs at its start, importable from here without importing torch until it
is used (PEP 562)::

    import planners

    started = planners.start("configs/deploy.yaml", pipe)   # merge, account, plan, pin, report

or step by step::

    from planners import load_config, plan_loaded, apply_pin_plan
    config = load_config("configs/minimax-h3-32g.yaml")
    plan = plan_loaded(config, components)          # accounts, plans, reports once
    pins = apply_pin_plan(plan, components, config)  # pinned in place, at exact size

``planners.execute`` runs a plan layer by layer (see planners.executor).
"""

from __future__ import annotations

from hostmem.lazy import lazy_exports, moved_modules

_NAMES_BY_MODULE = {
    "config": ("load_config", "parse_config", "ConfigError", "DeploymentConfig"),
    "startup": ("plan_loaded",),
    "server_start": ("start", "Started"),
    "deployment": ("plan_deployment", "DeploymentPlan"),
    "report": ("report_text", "report_dict"),
    "pin_apply": ("apply_pin_plan", "PinMismatch"),
    "providers": ("collect_offers", "remap_providers"),
    "executor": ("execute",),
}
_EXPORTS = {name: module for module, names in _NAMES_BY_MODULE.items() for name in names}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
# What the plan asks of the executor lives below the plan (the executor runs plans, so it
# sits above them); the old paths answer with the same modules.
moved_modules(__name__, {
    "executor.roles": "layer_roles", "executor.tier": "executor_tier",
    "executor.calibration": "calibration", "executor.guard": "offload_hooks",
})
