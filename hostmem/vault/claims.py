"""The keys this process has open: a second flock of its own on one key would deadlock, so a
second session on an open key is refused at once, naming what to close."""

from __future__ import annotations

import threading

from .safety import VaultError

__all__ = ["claim_in_process", "unclaim_in_process"]

_OPEN_KEYS: set[str] = set()  # keys open in this process: a second flock of ours would deadlock
_OPEN_KEYS_LOCK = threading.Lock()


def claim_in_process(key: str) -> None:
    with _OPEN_KEYS_LOCK:
        if key in _OPEN_KEYS:
            raise VaultError(f"LoRA merge cache {key[:12]} is already open in this process; close that session first")
        _OPEN_KEYS.add(key)


def unclaim_in_process(key: str) -> None:
    with _OPEN_KEYS_LOCK:
        _OPEN_KEYS.discard(key)
