"""Readers: a sealed, verified combination is served under its key's lock held SHARED.

A plain session holds the key's lock exclusively because it may adopt, drop, rebuild
and seal. A start that finds the combination sealed complete, every layer of it vouched
for by the verification memo (the very file written or verified, unchanged since), and
nothing else in the folder, has none of that to do: it only maps the files. Such starts
(the ranks of a host right after their shared build, servers starting together on a
cache built ahead of time) take the lock shared and map together, instead of one after
the other:

- the shared lock keeps out every writer: a plain session, eviction, ``prune`` and
  ``rm`` all take the key's lock exclusively, so nothing is dropped, rebuilt or removed
  while a reader maps;
- a reader never writes a layer or the manifest: every ``put`` answers None, a layer
  whose header no longer matches the manifest when ``get`` maps it is not served and
  nothing is removed, only the problem recorded as ``cache verify`` records damage (so
  the next start takes the plain way, which verifies every layer, rebuilds what changed
  and clears the record; without it, every start would vouch for the same manifest and
  stop at the same layer), and closing only records the use (the manifest's mtime, as a
  plain session that served a sealed combination does);
- anything else (no manifest, incomplete, a layer not vouched for, recorded damage, an
  unrecorded layer file, another shape or dtype, or a writer holding the lock) and
  :func:`open_sealed` lets go and answers None: the caller opens the plain way, which
  waits for the writer, verifies, drops and rebuilds.

A reader leaving removes the lock file when it is the last one, under the lock taken
exclusively for that instant; a reader arriving just then is refused the shared lock,
so a refusal is asked again for a moment (:data:`DEPARTING_READER_S`) before it is
taken for a writer at work. Without that, four ranks mapping together after their
shared build, the first to finish could send another to the plain open, where it
waited and adopted (seen on a loaded 2-core machine).
"""

from __future__ import annotations

import os
import time

from .adoption import Adopted, shape_dtype_problem
from .combinations import lock_path, use_path
from .layer_file import is_layer_file_name
from .leases import use_lease
from .locks import KeyLock, describe_holders, held_by_others, lock_holders
from .manifest import ManifestError, inputs_problem, read_manifest, touch_use_time
from .provisional import is_provisional
from .checks import RootChanged
from .safety import VaultError, check_folder_safe
from .claims import claim_in_process, unclaim_in_process
from .session import VaultSession, say
from .verification import VerifiedMemo, read_damage, record_damage

__all__ = ["DEPARTING_READER_S", "SealedSession", "open_sealed"]

DEPARTING_READER_S = 0.25  # how long a refused reader asks again: a leaving reader holds the lock for an unlink


class SealedSession(VaultSession):
    """A session over a sealed, verified combination, its lock held shared: gets only."""

    def _drop(self, reason: str) -> None:
        """A layer changed since it was sealed (found as ``get`` maps it): not served, and
        nothing removed under a shared lock; the merge builds it elsewhere or in place.
        The problem is recorded as damage, so the next start opens the plain way, which
        verifies every layer and rebuilds what changed. A map that failed for the
        process's own sake (out of file descriptors or address space) records nothing: a
        record would send the next start to read every layer again, and ``prune`` would
        remove a good combination."""
        if self._map_passing:
            then = "nothing is wrong with its files: the next start maps it again"
        else:
            try:
                record_damage(self.folder, [reason])
                then = "the next start verifies it and rebuilds what changed"
            except OSError as exc:
                then = (f"its damage could not be recorded ({exc}); run `hostmem cache verify` on this root, "
                        "then the next start rebuilds what changed")
        say(f"{self.vault.label} {self.key[:12]}: not serving the combination ({reason}); {then}")
        self._entries.clear()
        self._was_complete = False
        self.stats["dropped"] = reason
        self.writable = False
        self.last_error = f"{self.vault.label} {self.key[:12]} changed while it was served ({reason})"

    def close(self, behind: bool = False) -> None:  # nothing to seal behind
        self._close_shared(self._record_use)

    def _record_use(self) -> None:
        if not self.stats["dropped"]:
            touch_use_time(self.folder)  # for the LRU order, as a plain session serving it unchanged does


def _vouched(folder: str, expected: dict, inputs: dict) -> Adopted | None:
    """What a plain session would adopt without reading a layer, when that is everything:
    a sealed, complete manifest holding the ``expected`` layers (shapes and dtypes), each
    vouched for by the memo, no recorded damage, no other layer file, not provisional.
    Else None; nothing is read beyond the manifest, the memo and the folder's listing (a
    layer to verify is the plain session's to read, and to record)."""
    if is_provisional(folder) or read_damage(folder) is not None:
        return None
    try:
        manifest = read_manifest(folder)
    except ManifestError:
        return None
    if manifest is None or not manifest.complete or inputs_problem(manifest, inputs):
        return None
    layers, memo = manifest.layers, VerifiedMemo(folder)
    if any(n not in layers or shape_dtype_problem(layers[n], s, d) for n, (s, d) in expected.items()):
        return None
    files = {e.file for e in layers.values()}
    if any(is_layer_file_name(f) and f not in files for f in memo.dir.run(os.listdir)):
        return None
    if not all(memo.holds(e) for e in layers.values()):
        return None
    return Adopted(dict(layers), manifest, memo=memo, vouched=True)


def open_sealed(vault, hex_key: str, inputs: dict, expected: dict | None) -> SealedSession | None:
    """A :class:`SealedSession` of ``hex_key`` when the combination is sealed complete and
    verified with exactly the ``expected`` layers' shapes and dtypes, and no writer holds
    its lock; else None, having changed nothing (see the module's docstring)."""
    folder = os.path.join(vault.cache, hex_key)
    if expected is None or vault.read_only or not os.path.isfile(os.path.join(folder, "manifest.json")):
        return None
    check_folder_safe(folder)  # ours and private, as the plain open checks it: one lstat
    claim_in_process(vault.cache, hex_key)
    lock = KeyLock(lock_path(vault.cache, hex_key))
    served, foreign = None, None
    try:
        try:
            if not _take_shared(lock) and not (foreign := _held_by_another_user(lock)):
                return None  # a writer at work: the plain open waits for it
        except VaultError:
            return None  # a lock file the cache may not trust: the plain open says so, and merges in place
        try:
            adopted = _vouched(folder, expected, inputs)
            lease = None if adopted is None else use_lease(use_path(vault.cache, hex_key))  # before any view
        except RootChanged:
            raise
        except (PermissionError, VaultError):
            return None  # a part this user may not open or trust: the plain open names it, and merges in place
        if adopted is None:
            return None
        session = SealedSession(vault, hex_key, folder, (lock, lease), inputs, adopted, expected, 0.0, [])
        if not session.complete:
            return None
        session.writable = False
        session.last_error = f"{vault.label} {hex_key[:12]} is open only to map it (sealed and verified)"
        if foreign:
            say(f"{lock.path}: held by {foreign}, another user; serving the sealed combination without it (its "
                "files are this user's own and private). Make the cache root private (`chmod -R go-rwx` on it) so "
                "that nobody else can open its locks")
        served = session
        return served
    finally:
        if served is None:  # not served (or an error): let go, having changed nothing
            if lock.held:
                lock.release_and_remove_if_alone()
            unclaim_in_process(vault.cache, hex_key)


def _held_by_another_user(lock: KeyLock) -> str | None:
    """Who holds the key's lock, where only another user's processes do: no writer of
    ours can take it either, so nothing of ours drops, rebuilds or removes the
    combination, and its files are ours and private (checked as they are mapped): it is
    served without the lock, instead of waiting for ever. None otherwise."""
    holders = lock_holders(lock.path)
    return describe_holders(holders) if held_by_others(holders) else None


def _take_shared(lock: KeyLock) -> bool:
    """Take ``lock`` shared without waiting on a writer: a refusal is asked again for up to
    :data:`DEPARTING_READER_S` (a reader leaving holds the lock exclusively for an
    instant), then answered False."""
    deadline = time.monotonic() + DEPARTING_READER_S
    pause = 0.001
    while not lock.acquire(exclusive=False, blocking=False):
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, 0.02)
    return True
