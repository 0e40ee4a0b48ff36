"""Several cache roots, in order: which one a combination is served from or built in.

Every provider that stores through the vault (the LoRA merge cache, checkpoint remap's
spill) takes ``cache_root`` the same way: one path, an ordered list of them, or None for
the default root (``$HOSTMEM_CACHE_ROOT``, else ``~/.cache/hostmem``). A read-only root
(a cache baked into an image) serves a combination it holds complete and verified, and
so does a writable root where it is sealed: the first root in the list that holds it
serves it; a miss builds in the first writable root, and with none writable the first
read-only root serves what it has while every put answers None with the reason. Kept
here, below the providers, so that they resolve roots alike and imports point down.
"""

from __future__ import annotations

import os

from ..errors import InputError
from .combinations import default_cache_root
from .identity import CacheKey

__all__ = ["cache_roots", "keyer", "open_in_roots"]


def cache_roots(cache_root) -> list[str]:
    """The ordered cache roots given: one path, a list of them, or None for the default
    root (``$HOSTMEM_CACHE_ROOT``, else ``~/.cache/hostmem``)."""
    if cache_root is None:
        listed = [default_cache_root()]
    elif isinstance(cache_root, (str, os.PathLike)):
        listed = [cache_root]
    else:
        listed = list(cache_root)
    if not listed:
        raise InputError("cache_root: an empty list of cache roots; give at least one "
                         "(a LoRA merge may instead take enabled=False to merge in place)")
    return [os.path.abspath(os.path.expanduser(os.fspath(r))) for r in listed]


def keyer(vaults: list):
    """The vault of a start's roots whose memo of input digests its keys are computed with:
    the first writable one (which keeps what is hashed for the next start), else the first."""
    return next((v for v in vaults if not v.read_only), vaults[0])


def open_in_roots(vaults: list, key: CacheKey, expected: dict):
    """``(vault, session)``: the first root, in order, holding the combination complete and
    verified (a read-only one, or a writable one where it is sealed: served without its
    lock, as :func:`~.readers.open_sealed` serves it), else the first writable root to
    build in, else (none writable) the first read-only one, whose session serves what it
    has and answers every put with why it cannot.

    So a root listed after the first writable one is looked in too: a cache image that
    ``hostmem lora merge`` wrote into one root serves a server whose list puts another,
    empty, writable root before it (ccache's secondary storage, read before building)."""
    from .readers import open_sealed

    fallback = None
    for vault in vaults:
        if vault.read_only:
            session = vault.open(key, expected)
            if session.complete:
                if fallback is not None:
                    fallback[1].close()
                return vault, session
            if fallback is None and session.layers:
                fallback = (vault, session)
            else:
                session.close()
            continue
        sealed = open_sealed(vault, key.hex, key.inputs, expected)
        if sealed is not None:
            if fallback is not None:
                fallback[1].close()
            return vault, sealed
    writable = next((v for v in vaults if not v.read_only), None)
    if writable is not None:
        if fallback is not None:
            fallback[1].close()
        return writable, writable.open(key, expected)
    return fallback or (vaults[0], vaults[0].open(key, expected))
