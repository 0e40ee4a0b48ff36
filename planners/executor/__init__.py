"""The executor: runs a :class:`~planners.deployment.DeploymentPlan` on loaded components.

See :mod:`.run` (the context manager), :mod:`.roles` (what the plan makes of each
layer), :mod:`.readahead` (read-ahead and release), :mod:`.device_copy` (the CUDA
copies) and :mod:`.stats` (what is measured).
"""

from .roles import ComponentRoles, disk_tier, plan_roles
from .run import Executor, execute
from .stats import ExecutorStats, PassStats, read_io_bytes

__all__ = ["ComponentRoles", "Executor", "disk_tier", "ExecutorStats", "PassStats", "execute", "plan_roles", "read_io_bytes"]
