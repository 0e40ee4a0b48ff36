"""How each layer is summed: the kernels' candidates, timed on this machine and remembered.

:func:`plan_kernels` picks, per shape class, the fastest kernel of
:mod:`lora_cache.compute.merge_math` as measured here (remembered in ``<root>/kernel_wisdom.json``
under the CPU model and flags, torch's version, the dtype, the class and the thread
count); the cache key names the choice (:func:`.policy.merge_policy`), so no start
is served bytes its own kernel would not have produced. :func:`block_workers` are the
threads the row blocks run on.
"""

from .plan import KernelPlan, measure_kernels, plan_for_targets, plan_kernels, shape_class
from .wisdom import WISDOM_FILE, Wisdom, machine
from .workers import BlockWorkers, block_workers, cpu_count, worker_count

__all__ = [
    "WISDOM_FILE",
    "BlockWorkers",
    "KernelPlan",
    "Wisdom",
    "block_workers",
    "cpu_count",
    "machine",
    "measure_kernels",
    "plan_for_targets",
    "plan_kernels",
    "shape_class",
    "worker_count",
]
