"""The one question a merge asks of torch.distributed before anything else: is there a
process group of two ranks or more (then :mod:`lora_cache.shared_build` coordinates the
host's ranks), and the ``rank_timeout`` a shared build's ranks wait for each other.

Kept apart from :mod:`lora_cache.shared_build` so that a start without a process group
never imports the shared build (a cache hit pays for every module its first call loads).
"""

from __future__ import annotations

import math

from hostmem.errors import InputError

__all__ = ["DEFAULT_TIMEOUT", "check_rank_timeout", "distributed_group"]

DEFAULT_TIMEOUT = 600.0


def check_rank_timeout(value) -> float:
    """``merge``'s ``rank_timeout``, the seconds a rank waits for the others at a gather, as
    a float; a ValueError saying what to pass when it is not a finite number above 0."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(value, bool) or not (seconds > 0 and math.isfinite(seconds)):
        raise InputError(f"rank_timeout={value!r}: expected a number of seconds above 0 (for example 600)")
    return seconds


def distributed_group():
    """``torch.distributed`` when a process group of two ranks or more is initialised, else None."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    return dist
