"""Checks of the machine that a plan reports as warnings (they read /proc and stat the
cache roots; nothing is created)."""

from __future__ import annotations

import os
import stat

from hostmem.procfs import Mount, filesystem_of, is_shmem_fs, read_mounts

from .config import DeploymentConfig

__all__ = ["cache_root_warnings", "missing_adapter_warnings"]

# Filesystems of the kernel's own: no folder a cache could keep its files in.
_PSEUDO_FS = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "devpts", "debugfs", "tracefs", "securityfs",
                        "pstore", "bpf", "configfs", "fusectl", "mqueue", "hugetlbfs", "binfmt_misc"})


def cache_root_warnings(config: DeploymentConfig, mounts: list[Mount] | None = None) -> list[str]:
    """What will stop the LoRA cache from doing its job at the configured roots.

    A root on tmpfs keeps merged weights as shmem, as unreclaimable as anonymous memory;
    a root that is a file, under a file, on a kernel filesystem or not ours fails every
    merge there; and with no root a build can be written into, a combination not cached
    yet merges in place. The plan's figures assume the cache works: these say where it
    will not, before a start finds out.
    """
    lora = config.lora
    if lora is None or not lora.cache.enabled or not (lora.cache.roots or lora.cache.root):
        return []
    from hostmem.vault.safety import root_is_read_only  # here: a plan without a cache imports no vault
    mounts = read_mounts() if mounts is None else mounts
    roots = lora.cache.roots or (lora.cache.root,)
    key = "lora.cache.roots" if len(roots) > 1 or "lora.cache.roots" in config.origin.lines else "lora.cache.root"
    warnings, writable = [], False
    for root in roots:
        where = f"{key} {root} ({config.origin.where(key)})"
        problem = _root_problem(root, mounts)
        if problem is not None:
            warnings.append(f"{where}: {problem}")
        elif is_shmem_fs(root, mounts):
            mount = filesystem_of(root, mounts)
            warnings.append(
                f"{where} is on {mount.fs_type} (mounted at {mount.mount_point}): cached weights there are shmem, "
                "as unreclaimable as anonymous memory; put the cache on a disk-backed filesystem"
            )
        else:
            writable = writable or not root_is_read_only(root)
    if not writable and not warnings:
        warnings.append(
            f"{key} {', '.join(roots)} ({config.origin.where(key)}): no root can take a build (read-only or "
            "not writable by this user): a combination none of them holds merges in place, as anonymous memory; "
            "add a writable root last, or build the combination ahead of time (`hostmem lora merge`)"
        )
    return warnings


def _root_problem(root: str, mounts: list[Mount]) -> str | None:
    """Why a merge at ``root`` would fail, or None."""
    from hostmem.vault import VaultError
    from hostmem.vault.safety import check_folder_private, check_owned, check_path, nearest_existing

    mount = filesystem_of(root, mounts)
    if mount is not None and mount.fs_type in _PSEUDO_FS:
        return (f"is on the kernel's {mount.fs_type} filesystem (mounted at {mount.mount_point}), which holds no "
                "cache; every merge there fails. Choose a folder on a disk-backed filesystem")
    found = nearest_existing(root)
    try:
        st = os.stat(found)
    except OSError as exc:
        return f"cannot be checked ({exc.strerror or exc} at {found}); every merge there may fail"
    if not stat.S_ISDIR(st.st_mode):
        what = "exists and is not a folder" if found == root else f"cannot be created: {found} is a file, not a folder"
        return f"{what}; every merge there fails. Choose another cache root"
    try:
        if found == root:
            check_owned(root, st)
            check_folder_private(root, st)
        check_path(root)  # every folder from / down, as a start walks it
    except VaultError as exc:
        return f"every merge there fails: {exc}"
    return None


def missing_adapter_warnings(config: DeploymentConfig) -> list[str]:
    """A declared-size plan reads no adapter file, so a missing one stops nothing here; a
    server will need it. Each missing file is named, with the key and line that name it.
    (With weights on this machine the plan reads the adapters, and a missing one is an error.)"""
    out = []
    for i, adapter in enumerate(config.lora.adapters if config.lora else ()):
        if not os.path.exists(adapter.path):
            out.append(f"adapter {adapter.path} ({config.origin.where(f'lora.adapters[{i}].path')}) does not exist: "
                       "this plan takes its targets from declared lora_targets, but a server loading this config "
                       "will stop there; write the file or fix the path")
    return out
