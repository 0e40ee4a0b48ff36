"""The merge cache's one environment setting, the kill switch (torch-free, so planners can ask it)."""

from __future__ import annotations

import os

DISABLE_ENV = "HOSTMEM_DISABLE_LORA_MERGE_CACHE"


def cache_disabled_by_env() -> bool:
    """``HOSTMEM_DISABLE_LORA_MERGE_CACHE=1`` forces the in-place path everywhere."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")
