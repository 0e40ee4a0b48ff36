"""planners: deployment config, host budget, device and pin plans, report, the CLI.

What a server needs at its start, importable from here without importing torch
until it is used (PEP 562)::

    import planners

    started = planners.start("configs/deploy.yaml", pipe)   # merge, account, plan, pin, report

or step by step: ``load_config``, ``plan_loaded``, ``apply_pin_plan``.
"""

from hostmem.lazy import lazy_exports

_EXPORTS = {
    "load_config": "config",
    "ConfigError": "config",
    "plan_loaded": "startup",
    "apply_pin_plan": "pin_apply",
    "start": "server_start",
    "Started": "server_start",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
