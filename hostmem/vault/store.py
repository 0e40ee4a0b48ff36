"""A cache root: where combinations are opened, from a writable root or a read-only one.

The store's contract is in the package docstring (:mod:`hostmem.vault`).
"""

from __future__ import annotations

import os
import time

from hostmem.units import parse_size

from .adoption import Adopted, adopt
from .combinations import (
    CACHE_DIR,
    cache_bytes,
    cache_dir,
    default_cache_root,
    evict_lru,
    is_key,
    list_combinations,
    lock_path,
    sweep_dead_temporaries,
    use_path,
)
from .content_hash import MEMO_NAME
from .durable import free_bytes
from .identity import CacheKey, adapter_identity, base_identity
from .leases import use_lease
from .locks import KeyLock, describe_holders, lock_holders
from .safety import VaultError, check_folder_safe, make_private_dir, prepare_root, root_is_read_only
from .readers import open_sealed
from .session import VaultSession, claim_in_process, say, still_needed, unclaim_in_process
from .space import SpaceCheck

__all__ = ["Vault", "default_cache_root", "DEFAULT_HEADROOM", "MEMO_NAME"]

DEFAULT_HEADROOM = 256 * 1024 * 1024
DEFAULT_LOCK_WAIT_S = 1800.0  # see lock_wait_s


def lock_wait_s() -> float:
    """How long a start waits for another process of this user's holding its key's lock
    before it merges in place: ``HOSTMEM_LOCK_TIMEOUT`` seconds, else
    :data:`DEFAULT_LOCK_WAIT_S` (a build of a large model takes minutes; one that holds
    the lock much longer is stuck)."""
    text = os.environ.get("HOSTMEM_LOCK_TIMEOUT", "")
    try:
        return max(0.0, float(text)) if text else DEFAULT_LOCK_WAIT_S
    except ValueError:
        raise VaultError(f"HOSTMEM_LOCK_TIMEOUT={text!r}: not a number of seconds") from None


def _lock_key(cache: str, key: str, label: str) -> tuple[KeyLock | None, float, str | None]:
    """Take the key's exclusive lock, saying so when another process holds it:
    ``(lock, seconds waited, None)``, or ``(None, seconds waited, why)`` when the start
    must merge in place instead (a lock file it may not trust, a holder of another
    user's, or one that held it past :func:`lock_wait_s`)."""
    lock = KeyLock(lock_path(cache, key))
    try:
        if lock.acquire(blocking=False):
            return lock, 0.0, None
    except VaultError as refused:
        return None, 0.0, str(refused)
    holders = describe_holders(lock_holders(lock.path))
    if any(uid != os.geteuid() for _, uid in lock_holders(lock.path)):
        return None, 0.0, f"its lock {lock.path} is held by {holders}, another user, who may not steer this cache"
    bound = lock_wait_s()
    say(f"{label} {key[:12]} is in use by another process (most likely building it); waiting up to {bound:.0f} s "
        f"for it to finish (held by {holders}; lock {lock.path}), then using what it built")
    started = time.monotonic()
    pause = 0.005
    while not lock.acquire(blocking=False):
        waited = time.monotonic() - started
        if waited >= bound:
            return None, waited, (f"its lock {lock.path} is still held by {describe_holders(lock_holders(lock.path))} "
                                  f"after {waited:.0f} s (HOSTMEM_LOCK_TIMEOUT)")
        time.sleep(min(pause, max(bound - waited, 0.001)))
        pause = min(2 * pause, 0.25)
    waited = time.monotonic() - started
    say(f"{label} {key[:12]}: waited {waited:.1f} s; adopting it")
    return lock, waited, None


class Vault:
    """A cache root. Cheap to create; all work happens in :meth:`open`.

    A root this process cannot write (a read-only filesystem, an image layer) is
    ``read_only``: it is never written, not even a lock file, and :meth:`open` serves
    from it only what is there and verified. A writable root is swept of the
    temporary files of writers that are no longer running. ``label`` names what it
    stores in the messages it prints (which cache waited, dropped or rebuilt what).
    """

    def __init__(self, root: str | os.PathLike, max_size: int | str | None = None,
                 headroom: int | str = DEFAULT_HEADROOM, label: str = "LoRA merge cache"):
        self.label = label
        self.read_only = root_is_read_only(root)
        self.root = prepare_root(root, create=not self.read_only)
        self.cache = os.path.join(self.root, CACHE_DIR) if self.read_only else cache_dir(self.root)
        self.max_size = None if max_size is None else parse_size(max_size)
        self.headroom = parse_size(headroom)
        if not self.read_only:
            sweep_dead_temporaries(self.cache)

    @property
    def memo_file(self) -> str | None:
        """The on-disk memo of input content digests (a hint: losing it costs a rehash);
        None for a read-only root."""
        return None if self.read_only else os.path.join(self.cache, MEMO_NAME)

    def adapter_identity(self, path: str, strength: float, alpha_override: float | None) -> dict:
        """:func:`adapter_identity` with the memo kept under this root across starts."""
        return adapter_identity(path, strength, alpha_override, memo_file=self.memo_file)

    def base_identity(self, shard_paths: list[str]) -> dict:
        """:func:`base_identity` with the memo kept under this root across starts."""
        return base_identity(shard_paths, memo_file=self.memo_file)

    def combinations(self):
        """Every combination on disk, least recently used first (see ``combinations``)."""
        return list_combinations(self.cache) if os.path.isdir(self.cache) else []

    def space(self, key: str, needed: int) -> SpaceCheck:
        """How much of ``needed`` fits now, by free disk and by ``max_size``."""
        if self.read_only:
            return SpaceCheck(needed, 0, 0, self.headroom, self.max_size, os.path.join(self.cache, key), read_only=True,
                              label=self.label)
        free = free_bytes(self.cache)
        available = free - self.headroom
        if self.max_size is not None:
            available = min(available, self.max_size - cache_bytes(self.cache))
        return SpaceCheck(needed, available, free, self.headroom, self.max_size, os.path.join(self.cache, key),
                          label=self.label)

    def open(self, key: CacheKey | str, expected_layers: dict | None = None) -> "VaultSession":
        """Lock, adopt, make room, and return a session (see the package's contract)."""
        hex_key = key.hex if isinstance(key, CacheKey) else str(key)
        if not is_key(hex_key):
            raise VaultError(f"{hex_key!r} is not a cache key (64 lowercase hex digits from cache_key())")
        if self.read_only:
            return self._open_read_only(key, hex_key, expected_layers)
        inputs = key.inputs if isinstance(key, CacheKey) else {}
        sealed = open_sealed(self, hex_key, inputs, expected_layers)  # maps beside other readers, no waiting
        if sealed is not None:
            return sealed
        claim_in_process(hex_key)
        lock = None
        try:
            lock, waited, why_not = _lock_key(self.cache, hex_key, self.label)
            if lock is None:
                unclaim_in_process(hex_key)
                return self._in_place(key, hex_key, expected_layers, waited, why_not)
            lease = use_lease(use_path(self.cache, hex_key))  # under the key's lock, before any view
            folder = os.path.join(self.cache, hex_key)
            make_private_dir(folder)
            adopted = adopt(folder, expected_layers, inputs=key.inputs if isinstance(key, CacheKey) else None)
            _tell(self.label, hex_key, adopted)
            needed = still_needed(adopted.entries, expected_layers)
            evicted = evict_lru(self.cache, hex_key, needed, self.max_size, self.headroom)
            inputs = key.inputs if isinstance(key, CacheKey) else {}
            return VaultSession(self, hex_key, folder, (lock, lease), inputs, adopted, expected_layers, waited, evicted)
        except BaseException:
            if lock is not None:
                lock.release()
            unclaim_in_process(hex_key)
            raise

    def _in_place(self, key, hex_key: str, expected_layers: dict | None, waited: float, why: str) -> "VaultSession":
        """A session that serves nothing and stores nothing, holding no lock: every layer
        merges in place, with the one warning the merge gives from ``last_error``."""
        inputs = key.inputs if isinstance(key, CacheKey) else {}
        session = VaultSession(self, hex_key, os.path.join(self.cache, hex_key), (None, None), inputs,
                               Adopted({}, None), expected_layers, waited, [])
        session.writable = False
        session.last_error = f"{self.label} {hex_key[:12]}: not used ({why})"
        return session

    def _open_read_only(self, key, hex_key: str, expected_layers: dict | None) -> "VaultSession":
        """A session that serves what a read-only root holds, verified, and writes nothing."""
        folder = os.path.join(self.cache, hex_key)
        if os.path.isdir(folder) and not os.path.islink(folder):
            check_folder_safe(folder)
            adopted = adopt(folder, expected_layers, writable=False,
                            inputs=key.inputs if isinstance(key, CacheKey) else None)
            _tell(self.label, hex_key, adopted, read_only=True)
        else:
            adopted = Adopted({}, None)
        inputs = key.inputs if isinstance(key, CacheKey) else {}
        return VaultSession(self, hex_key, folder, (None, None), inputs, adopted, expected_layers, 0.0, [])


def _tell(label: str, key: str, adopted: Adopted, read_only: bool = False) -> None:
    """Say what adoption found wrong: which file, and why, and what happens now."""
    then = "not serving it (a read-only root)" if read_only else "rebuilding it"
    if adopted.dropped:
        say(f"{label} {key[:12]}: dropped the whole combination ({adopted.dropped}); {then}")
    for shown, (name, why) in enumerate(sorted(adopted.failed.items())):
        if shown == 5:
            say(f"{label} {key[:12]}: ... and {len(adopted.failed) - 5} more layer(s) like these")
            break
        say(f"{label} {key[:12]}: layer {name!r} failed its check ({why}); {then}")
