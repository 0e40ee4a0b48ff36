"""The executor: runs a :class:`~planners.deployment.DeploymentPlan` on loaded components.

See :mod:`.run` (the context manager), :mod:`.roles` (what the plan makes of each
layer), :mod:`.tier` (the plan's disk figures under the executor), :mod:`.readahead`
(read-ahead and release), :mod:`.device_copy` (the CUDA copies) and :mod:`.stats`
(what is measured). The names that need torch are imported on first use, so that the
planner can ask :mod:`.roles` what the executor will read without importing torch.
"""

from ..layer_roles import ComponentRoles, disk_tier, plan_roles

__all__ = ["ComponentRoles", "Executor", "disk_tier", "ExecutorStats", "PassStats", "execute", "plan_roles", "read_io_bytes"]

_LAZY = {"Executor": "run", "execute": "run", "ExecutorStats": "stats", "PassStats": "stats", "read_io_bytes": "stats"}


def __getattr__(name: str):
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
