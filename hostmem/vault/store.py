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
from .locks import KeyLock, describe_holders, foreign_hold, held_by_others, lock_holders, lock_wait_s, say
from .checks import RootChanged
from .safety import VaultError, check_folder_safe, make_private_dir, prepare_root, root_is_read_only
from .readers import open_sealed
from .claims import claim_in_process, unclaim_in_process
from .session import VaultSession
from .space import SpaceCheck, still_needed

__all__ = ["Vault", "default_cache_root", "alternate_key", "DEFAULT_HEADROOM", "MEMO_NAME"]

DEFAULT_HEADROOM = 256 * 1024 * 1024
ALTERNATES = 4  # copies of one combination built beside a key whose lock another user holds


def alternate_key(hex_key: str, n: int) -> str:
    """The ``n``-th key (64 hex digits) a combination is built under while another user
    holds ``hex_key``'s lock: the same for every start of this user's, so they share it."""
    import hashlib

    return hashlib.sha256(f"{hex_key}/held-by-another-user/{n}".encode()).hexdigest()


def _lock_key(cache: str, key: str, label: str) -> tuple[KeyLock | None, float, str | None, bool]:
    """Take the key's exclusive lock, saying so when another process holds it:
    ``(lock, seconds waited, None, False)``, or ``(None, seconds waited, why, foreign)``
    when it cannot: ``foreign`` where another user holds it (never work of ours: the
    caller builds a copy of its own under another key at once), else a lock file it may
    not trust, or one of ours that held it past :func:`~.locks.lock_wait_s`."""
    lock = KeyLock(lock_path(cache, key))
    try:
        if lock.acquire(blocking=False):
            return lock, 0.0, None, False
    except RootChanged:
        raise
    except VaultError as refused:
        return None, 0.0, str(refused), False
    holders = lock_holders(lock.path)
    if held_by_others(holders):
        return None, 0.0, f"its lock {lock.path} is held by {describe_holders(holders)}, another user", True
    if foreign_hold(holders, lock.exposed) and not lock.acquire(blocking=False):  # not one just let go
        return None, 0.0, (f"its lock {lock.path}, which others could open, is held by {describe_holders(holders)}; "
                           "it may be another user's"), True
    if lock.held:
        return lock, 0.0, None, False
    bound = lock_wait_s()
    say(f"{label} {key[:12]} is in use by another process (most likely building it); waiting up to {bound:.0f} s "
        f"for it to finish (held by {describe_holders(holders)}; lock {lock.path}), then using what it built")
    started = time.monotonic()
    if not lock.acquire_within(bound):
        waited = time.monotonic() - started
        return None, waited, (f"its lock {lock.path} is still held by {describe_holders(lock_holders(lock.path))} "
                              f"after {waited:.0f} s (HOSTMEM_LOCK_TIMEOUT)"), False
    waited = time.monotonic() - started
    say(f"{label} {key[:12]}: waited {waited:.1f} s; adopting it")
    return lock, waited, None, False


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
        self.max_size = None if max_size is None else parse_size(max_size)
        self.headroom = parse_size(headroom)
        try:
            self.cache = os.path.join(self.root, CACHE_DIR) if self.read_only else cache_dir(self.root)
            if not self.read_only:
                _warn_if_others_can_read(self.root, self.cache)
                sweep_dead_temporaries(self.cache)
        except PermissionError as exc:  # a part of it this user may not open: named, with the fix
            raise VaultError(f"{self.root}: not usable as a cache root: {exc.strerror}") from None

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
        for n in range(ALTERNATES + 1):
            candidate = hex_key if n == 0 else alternate_key(hex_key, n)
            try:
                sealed = open_sealed(self, candidate, inputs, expected_layers)  # beside other readers, no waiting
                session = sealed if sealed is not None else self._open_locked(key, candidate, inputs, expected_layers)
            except PermissionError as exc:  # a part of it this user may not open (named, with the fix)
                return self._in_place(key, hex_key, expected_layers, 0.0, exc.strerror)
            if isinstance(session, VaultSession):
                return session
            say(f"{self.label} {candidate[:12]}: {session}, who may not steer this cache; "
                f"building a copy of this user's own beside it (key {alternate_key(hex_key, n + 1)[:12]}). Make the "
                f"cache root private (`chmod -R go-rwx {self.root}`) so that nobody else can open its locks")
        return self._in_place(key, hex_key, expected_layers, 0.0,
                              f"the locks of {ALTERNATES + 1} copies of it are held by other users")

    def _open_locked(self, key, hex_key: str, inputs: dict, expected_layers: dict | None) -> "VaultSession | str":
        """The plain session of ``hex_key`` under its exclusive lock; why not where another
        user holds that lock (the caller tries a copy of its own); a session merging in
        place where a process of ours held it too long or the lock file is not trusted."""
        claim_in_process(self.cache, hex_key)
        lock = None
        try:
            lock, waited, why_not, foreign = _lock_key(self.cache, hex_key, self.label)
            if lock is None:
                unclaim_in_process(self.cache, hex_key)
                return why_not if foreign else self._in_place(key, hex_key, expected_layers, waited, why_not)
            try:
                lease = use_lease(use_path(self.cache, hex_key))  # under the key's lock, before any view
            except RootChanged:
                raise
            except VaultError as refused:  # a use file it may not trust (a FIFO, a folder): as a lock file's
                lock.release()
                unclaim_in_process(self.cache, hex_key)
                return self._in_place(key, hex_key, expected_layers, waited, str(refused))
            folder = os.path.join(self.cache, hex_key)
            make_private_dir(folder)
            adopted = adopt(folder, expected_layers, inputs=key.inputs if isinstance(key, CacheKey) else None)
            _tell(self.label, hex_key, adopted)
            needed = still_needed(adopted.entries, expected_layers)
            evicted = evict_lru(self.cache, hex_key, needed, self.max_size, self.headroom)
            return VaultSession(self, hex_key, folder, (lock, lease), inputs, adopted, expected_layers, waited, evicted)
        except BaseException:
            if lock is not None:
                lock.release()
            unclaim_in_process(self.cache, hex_key)
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
        """A session that serves what a read-only root holds, verified, and writes nothing:
        the combination under its key, else a complete copy under one of its alternate keys
        (an image built while another user held the key's lock is there)."""
        inputs = key.inputs if isinstance(key, CacheKey) else {}
        first = None
        for n in range(ALTERNATES + 1):
            candidate = hex_key if n == 0 else alternate_key(hex_key, n)
            folder = os.path.join(self.cache, candidate)
            if not os.path.isdir(folder) or os.path.islink(folder):
                continue
            check_folder_safe(folder)
            adopted = adopt(folder, expected_layers, writable=False,
                            inputs=key.inputs if isinstance(key, CacheKey) else None)
            if first is None:
                first = (candidate, folder, adopted)
            if not still_needed(adopted.entries, expected_layers) and adopted.entries:
                first = (candidate, folder, adopted)
                break
        if first is None:
            return VaultSession(self, hex_key, os.path.join(self.cache, hex_key), (None, None), inputs,
                                Adopted({}, None), expected_layers, 0.0, [])
        candidate, folder, adopted = first
        _tell(self.label, candidate, adopted, read_only=True)
        return VaultSession(self, candidate, folder, (None, None), inputs, adopted, expected_layers, 0.0, [])


_WARNED_OPEN: set[str] = set()  # the roots this process said others can read


def _warn_if_others_can_read(root: str, cache: str) -> None:
    """Say once per root that others may read it: anyone who can open a lock file can hold
    its flock (a start then waits a bounded time and works around it, at a cost). The
    cache makes its folders 0700 and files 0600; an operator sharing an image may have
    opened them (``chmod -R go+rX``)."""
    if root in _WARNED_OPEN:
        return
    try:
        open_to = [p for p in (root, cache) if os.stat(p).st_mode & 0o055]
    except OSError:
        return
    if open_to:
        _WARNED_OPEN.add(root)
        say(f"{open_to[0]}: readable by other users (mode {os.stat(open_to[0]).st_mode & 0o7777:04o}), who can then "
            f"hold the cache's locks; starts work around that, at a cost. Run `chmod -R go-rwx {root}` unless "
            "others must read it.")


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
