"""Shares: several processes write disjoint layers of one combination at the same time.

A plain session holds its key's lock exclusively, so two processes opening one key
build one after the other. The ranks of one host split a missing combination's layers
instead (see :mod:`lora_cache.ranks.shared_build`), and each opens a share session over its
own part with :func:`open_share`:

- the key's lock ``<key>.lock`` is held SHARED, by every share at once: a plain
  session (which takes it exclusively, and may adopt, drop or evict) waits until every
  share has closed, and no remover can take the combination away meanwhile;
- ``<key>.lock.<i>of<n>`` is held exclusively: two builders of the same share (two
  jobs on one key) take turns, and the second finds the layers the first sealed;
- layers are written as a plain session writes them: each layer file is renamed into
  place only once written and synced, and carries its own checksum, so it is sealed on
  its own; a share writes no manifest (the shares would race over it). The next plain
  session adopts the share's files on their headers and verifies their checksums, as
  it adopts the files of a build that was killed, and seals the manifest: what a share
  sealed before its process died stays, and the next start resumes from it.
"""

from __future__ import annotations

import contextlib
import os
import time

from .anchor import listdir_in, lstat_in
from .adoption import Adopted, shape_dtype_problem
from .combinations import lock_path, use_path
from .content_hash import stamp_of
from .identity import CacheKey
from .layer_file import LayerEntry, layer_file_name, read_layer_file
from .leases import use_lease
from .locks import KeyLock, describe_holders, lock_holders
from .safety import VaultError, check_not_symlink, make_private_dir
from .claims import claim_in_process, unclaim_in_process
from .session import VaultSession, say
from .verification import VerifiedMemo

__all__ = ["ShareSession", "open_share", "share_lock_path", "vouch_for"]


def share_lock_path(cache: str, key: str, index: int, count: int) -> str:
    """``<key>.lock.<index>of<count>``: held by whoever builds share ``index`` of ``count``."""
    return f"{lock_path(cache, key)}.{index}of{count}"


class ShareSession(VaultSession):
    """A session over one share of a combination: get and put as any session; closing
    releases the locks and writes no manifest (the next plain session seals it)."""

    _share_lock: KeyLock | None = None
    _found: frozenset = frozenset()  # the share's layers already sealed when it opened

    def written(self) -> list[dict]:
        """What this session wrote, for the ranks that did not: each layer's entry and the
        stamp its file had when it was written and checksummed (see :func:`vouch_for`); a
        file changed since then no longer has it, and is read again on adoption."""
        return [{"entry": entry.to_dict(), "stamp": list(entry.stamp)}
                for name, entry in self.layers.items() if name not in self._found and entry.stamp is not None]

    def close(self, behind: bool = False) -> None:  # no manifest: all sealed now
        self._close_shared(self._release_share_lock)

    def _release_share_lock(self) -> None:
        if self._share_lock is not None:
            self._share_lock.release(remove=True)


def _sealed_of_share(folder: str, expected: dict) -> dict[str, LayerEntry]:
    """The share's layers already sealed in ``folder`` (a build that died, or the other
    builder of this share): found by their file names, kept where shape and dtype match.

    Their checksums are not read here: the plain session that adopts them verifies them.
    """
    found = {}
    for name, (shape, dtype) in expected.items():
        path = os.path.join(folder, layer_file_name(name))
        if not os.path.lexists(path):
            continue
        try:
            entry = read_layer_file(path)
        except (OSError, ValueError):
            continue  # rebuilt, and the rename replaces it
        if entry.name == name and shape_dtype_problem(entry, shape, dtype) is None:
            found[name] = entry
    return found


def _lock_shared(cache: str, key: str) -> tuple[KeyLock, float]:
    """Take the key's lock shared, saying so when a plain session holds it."""
    lock = KeyLock(lock_path(cache, key))
    if os.path.lexists(lock.path):
        check_not_symlink(lock.path)
    if lock.acquire(exclusive=False, blocking=False):
        return lock, 0.0
    say(f"LoRA merge cache {key[:12]} is in use by another process; waiting for it (lock {lock.path})")
    started = time.monotonic()
    _take_within(lock, exclusive=False)
    return lock, time.monotonic() - started


def _take_within(lock: KeyLock, exclusive: bool = True) -> None:
    """Take ``lock`` within the bounded wait; a :class:`VaultError` naming who holds it when
    not (the ranks then merge in place, as they do when a share cannot be written)."""
    if not lock.acquire_within(exclusive=exclusive):
        raise VaultError(f"{lock.path}: still held by {describe_holders(lock_holders(lock.path))} after the wait "
                         "(HOSTMEM_LOCK_TIMEOUT); not building this share")


def open_share(vault, key: CacheKey | str, expected: dict, index: int, count: int) -> ShareSession:
    """Open share ``index`` of ``count`` of ``key``: ``expected`` is the share's layers,
    ``{name: (shape, dtype)}``, disjoint from every other share's (the caller's split)."""
    hex_key = key.hex if isinstance(key, CacheKey) else str(key)
    if vault.read_only:
        raise VaultError(f"{vault.root}: a read-only cache root; a share of {hex_key[:12]} cannot be built there")
    if not 0 <= index < count:
        raise VaultError(f"share {index} of {count}: the index must be in 0..{count - 1}")
    claim_in_process(vault.cache, hex_key)
    locks: list[KeyLock] = []
    try:
        key_lock, waited = _lock_shared(vault.cache, hex_key)
        locks.append(key_lock)
        share_lock = KeyLock(share_lock_path(vault.cache, hex_key, index, count))
        _take_within(share_lock)
        locks.append(share_lock)
        lease = use_lease(use_path(vault.cache, hex_key))  # under the key's lock, before any view
        folder = os.path.join(vault.cache, hex_key)
        make_private_dir(folder)
        adopted = Adopted(_sealed_of_share(folder, expected), None)
        inputs = key.inputs if isinstance(key, CacheKey) else {}
        session = ShareSession(vault, hex_key, folder, (key_lock, lease), inputs, adopted, expected, waited, [])
        session._share_lock, session._found = share_lock, frozenset(adopted.entries)
        return session
    except BaseException:
        for lock in reversed(locks):
            lock.release()
        unclaim_in_process(vault.cache, hex_key)
        raise


def vouch_for(vault, key: str, written: list[dict]) -> int:
    """Record the layers other shares wrote as verified, on disk (``verified.json``) and in
    this process, so that the sessions opened next adopt them without reading them again.

    Each writer checksummed its layers' bytes as it wrote them, as a plain session does;
    a file counts only while it still has the stamp its writer saw (device, inode, size,
    mtime, ctime): one changed since is read and verified on adoption as usual. Returns
    how many were vouched for. Call it between the shares and the plain sessions (the
    shared build does, on one rank, before the others open the vault).
    """
    folder = os.path.join(vault.cache, key)
    memo, entries = VerifiedMemo(folder), {}
    for item in written:
        entry = LayerEntry.from_dict(item["entry"])
        with contextlib.suppress(OSError):
            if stamp_of(lstat_in(os.path.join(folder, entry.file))) == list(item["stamp"]):
                memo.record(entry)
                entries[entry.name] = entry
    if entries:
        memo.save({**_known(memo, folder), **entries})
    return len(entries)


def _known(memo: VerifiedMemo, folder: str) -> dict[str, LayerEntry]:
    """The layers the memo on disk vouched for already, so that saving keeps them."""
    known = {}
    for name in listdir_in(folder):
        path = os.path.join(folder, name)
        with contextlib.suppress(OSError, ValueError):
            entry = read_layer_file(path) if name.endswith(".safetensors") else None
            if entry is not None and memo.holds(entry):
                known[entry.name] = entry
    return known
