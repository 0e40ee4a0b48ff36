"""The combinations this process has open: a second flock of its own on one would deadlock,
so a second session on an open combination is refused at once, naming it.

A combination is its key's folder in one cache (the same key in two roots is two folders,
each with its own lock file: a build in one never stands in another's way).
"""

from __future__ import annotations

import os
import threading

from .safety import VaultError

__all__ = ["claim_in_process", "unclaim_in_process"]

_OPEN: set[str] = set()  # the folders open in this process: a second flock of ours would deadlock
_OPEN_LOCK = threading.Lock()


def claim_in_process(cache: str, key: str) -> None:
    """Mark ``key``'s combination in the cache folder ``cache`` open in this process; where
    a build of it is sealing behind its start here (:mod:`.behind`), once that is done."""
    from .behind import wait_sealed  # here: the store's light commands import this module, never torch

    folder = os.path.join(os.path.realpath(cache), key)  # one root under two spellings is one root
    wait_sealed(folder)
    with _OPEN_LOCK:
        if folder in _OPEN:
            raise VaultError(f"LoRA merge cache {key[:12]} in {cache} is already open in this process (a build or "
                             "a start of it is under way); wait for it, or close that session first")
        _OPEN.add(folder)


def unclaim_in_process(cache: str, key: str) -> None:
    with _OPEN_LOCK:
        _OPEN.discard(os.path.join(os.path.realpath(cache), key))
