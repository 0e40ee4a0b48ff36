"""Checks of the machine that a plan reports as warnings (they read /proc)."""

from __future__ import annotations

from hostmem.procfs import Mount, filesystem_of, is_shmem_fs, read_mounts

from .config import DeploymentConfig

__all__ = ["cache_root_warnings"]


def cache_root_warnings(config: DeploymentConfig, mounts: list[Mount] | None = None) -> list[str]:
    """Warn when the LoRA cache root is on tmpfs: files there are shmem, never reclaimable.

    A merged-weight cache exists to turn anonymous memory into page cache the kernel
    can drop; on tmpfs the same bytes stay in RAM whatever happens.
    """
    lora = config.lora
    if lora is None or not lora.cache.enabled or lora.cache.root is None:
        return []
    mounts = read_mounts() if mounts is None else mounts
    if not is_shmem_fs(lora.cache.root, mounts):
        return []
    mount = filesystem_of(lora.cache.root, mounts)
    return [
        f"lora.cache.root {lora.cache.root} ({config.origin.where('lora.cache.root')}) is on {mount.fs_type} "
        f"(mounted at {mount.mount_point}): cached weights there are shmem, as unreclaimable as anonymous "
        "memory; put the cache on a disk-backed filesystem"
    ]
