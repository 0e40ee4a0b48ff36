"""What tells two combinations of adapters apart within one process, cheaply: a switch to the
combination already held is a no-op (:mod:`.adapter_switch`); across processes the vault's
key, a digest of every input's content, does."""

from __future__ import annotations

import os

from ..adapters.spec import Adapter

__all__ = ["combination_identity"]


def combination_identity(specs: list[Adapter], cache_root: tuple[str, ...], shards: dict | None = None) -> tuple:
    """What tells two combinations apart in this process (the vault key does across them):
    each adapter's path and options, and the stamp of its files (an adapter rewritten at the
    same path is another adapter)."""
    parts = None if shards is None else repr(shards)  # checked by plan_targets, after this
    return (cache_root, parts) + tuple(
        (os.path.realpath(s.path), _stamps(s.path), float(s.strength), s.alpha, repr(s.rules), s.strict, s.rslora)
        for s in specs
    )


def _stamps(path: str) -> tuple:
    """The stamp (device, inode, size, mtime, ctime) of the adapter file ``path`` names, and of
    the config peft wrote beside it; None for one that cannot be stat'ed (planning says why)."""
    from hostmem.vault.content_hash import stamp_of

    from ..adapters.paths import adapter_file_in

    found = []
    for file in (adapter_file_in(path)[0], os.path.join(path, "adapter_config.json") if os.path.isdir(path) else None):
        try:
            found.append(tuple(stamp_of(os.stat(file))) if file else None)
        except OSError:
            found.append(None)
    return tuple(found)
