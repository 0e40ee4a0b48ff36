"""Folding the base's content hash into the build's own reads.

A start on a base whose digests are not memoised (new, copied, touched, freshly
unpacked) must read every byte of it to know the key. Hashing it first and then
building reads the base's target layers twice (the second time from the disk, where
the base is larger than the memory), and the two run one after the other. Folded,
the build runs under a provisional key (:func:`hostmem.vault.identity.provisional_key`)
while a hasher reads the same shards beside it, and the combination is re-keyed to its
real key once the digests are known (:mod:`hostmem.vault.rekey`):

- the hasher starts before the build's session opens (:meth:`Fold.start_hash`), so it
  reads its first window while the start measures its layers' rounding loss;
- the build reads its layers in file order (:meth:`FoldedSession.in_file_order`), and
  the hasher reads each shard sequentially at most :data:`FOLD_WINDOW` bytes ahead of
  the layer being built, so the pages it reads are in the page cache when the build
  asks for them, and a page comes off the disk once for both;
- when the build is done the hasher finishes at full speed, the digests are memoised
  as an unfolded start memoises them, and the folder takes its real key: in the seal's
  thread, behind the start, where the build was sealed behind it (:meth:`FoldedSession.close`).

A start only folds when no root can hold the combination: a complete combination
whose recorded inputs equal this start's in all but the base's digests, with base
shards of the same sizes, may well be the one (a copied base, a cache baked in a
read-only root), so then the base is hashed first and that one served without a build
(:func:`plan_fold`). A provisional folder is never served (:mod:`.provisional`).
"""

from __future__ import annotations

import os
import threading

from .content_hash import CONTENT_HASH_MEMO, file_digest
from .deferred import interrupts_deferred
from .durable import remove_tree
from .identity import (CacheKey, base_identity_of, cache_key, key_inputs, provisional_key, same_but_base_digests,
                       shard_identity)
from .combinations import lock_path
from .locks import KeyLock, describe_holders, lock_holders, lock_is_held
from .manifest import read_manifest
from .provisional import mark_provisional
from .rekey import rekey
from .behind import wait_sealed
from .session import say

__all__ = ["FOLD_WINDOW", "Fold", "FoldedSession", "plan_fold", "wait_for_a_folded_build"]

FOLD_WINDOW = 256 * 1024 * 1024  # how far the hasher reads ahead of the build (None: no limit)
_DEFAULT = object()


class _Stopped(Exception):
    """The folded build failed: its hasher stops where it is."""


class BuildCursor:
    """Where the build reads, as a position in the base's shards laid end to end; the
    hasher waits (:meth:`wait`) to stay within ``window`` bytes ahead of it."""

    def __init__(self, window: int | None):
        self._window = window
        self._at = 0
        self._free = window is None
        self._stopped = False
        self._changed = threading.Condition()

    def advance(self, position: int | None) -> None:
        """The build is about to read from ``position`` on (None: somewhere unknown)."""
        with self._changed:
            if position is None:
                self._free = True
            elif position > self._at:
                self._at = position
            self._changed.notify_all()

    def release(self) -> None:
        """The build has read everything it will: the hasher runs free."""
        self.advance(None)

    def stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify_all()

    def wait(self, upto: int) -> None:
        """Block until the hasher may read up to ``upto``; raise once the build failed."""
        with self._changed:
            while not self._stopped and not self._free and upto > self._at + self._window:
                self._changed.wait()
            if self._stopped:
                raise _Stopped()


class BaseHasher(threading.Thread):
    """Hashes the base's shards in order beside the build and memoises each digest as it
    is known (``memo_file``: the writable root's, as an unfolded start keeps it)."""

    def __init__(self, shards: list[tuple[str, list[int], str | None]], starts: list[int], cursor: BuildCursor,
                 memo_file: str | None):
        super().__init__(name="hostmem-fold-hash", daemon=True)
        self.shards, self.starts, self.cursor, self.memo_file = shards, starts, cursor, memo_file
        self.digests: list[str | None] = [known for _, _, known in shards]
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for i, (path, stamp, known) in enumerate(self.shards):
                if known is None:
                    digest = file_digest(path, gate=lambda upto, at=self.starts[i]: self.cursor.wait(at + upto))
                    CONTENT_HASH_MEMO.record(path, stamp, digest, self.memo_file)
                    self.digests[i] = digest
        except BaseException as exc:  # raised by result(), in the build's thread
            self.error = exc

    def stop(self) -> None:
        """Stop where it is (a start that will not build), and wait for it."""
        self.cursor.stop()
        self.join()

    def result(self) -> list[str]:
        self.join()
        if self.error is not None:
            raise self.error
        return self.digests


class Fold:
    """A start that will fold: the base's shards as they are now, the other inputs, and
    the writable root to build in (see :func:`plan_fold`)."""

    def __init__(self, writable, vaults, shards, inputs: dict, rest: tuple):
        self.writable, self.vaults, self.shards, self.inputs, self.rest = writable, vaults, shards, inputs, rest

    @property
    def paths(self) -> list[str]:
        """The shards, in the order the hasher reads them."""
        return [path for path, _, _ in self.shards]

    def start_hash(self, positions: dict[str, int | None], window=_DEFAULT) -> BaseHasher:
        """Start hashing the base beside the build about to run, before the build's
        session is open: the hasher reads its first window while this start measures the
        rounding loss of its layers (which waits on scattered reads more than on a core).
        ``positions``: where each layer's base starts in the shards laid end to end, in
        :attr:`shards`' order (None where unknown: then the hasher is not held back);
        ``window``: how far the hasher may read ahead of the layer being built (default
        :data:`FOLD_WINDOW`; 0: only what the build has read already; None: no limit)."""
        window = FOLD_WINDOW if window is _DEFAULT else window
        starts, at = [], 0
        for _, stamp, _ in self.shards:
            starts.append(at)
            at += stamp[2]
        known = None not in positions.values()
        hasher = BaseHasher(self.shards, starts, BuildCursor(window if known else None), self.writable.memo_file)
        hasher.start()
        return hasher

    def open(self, expected: dict, hasher: BaseHasher, positions: dict[str, int | None]):
        """The provisional session, hashed by ``hasher`` (:meth:`start_hash`, with the same
        ``positions``), or None where another start built and re-keyed this combination
        while this one waited: :meth:`hashed_meanwhile` (the key is then known, and the
        hasher stopped). On any error the hasher is stopped too."""
        key = provisional_key(self.inputs, [stamp for _, stamp, _ in self.shards])
        try:
            session = self.writable.open(key, expected)  # a dead builder's leftover is dropped here
            if session.stats["lock_wait_seconds"] > 0 and not session.layers and self.hashed_meanwhile():
                hasher.stop()
                session.close()  # nothing in it: its folder goes
                return None
            try:
                mark_provisional(session.folder, key.hex, [path for path, _, _ in self.shards])
            except BaseException:
                session.close()
                raise
        except BaseException:
            hasher.stop()
            raise
        return FoldedSession(session, self, hasher, hasher.cursor, positions)

    def hashed_meanwhile(self) -> bool:
        """Every shard's digest is memoised now, with the stamp it had when this start
        planned to fold: another start on the same base built under the same provisional
        key while this one waited for its lock, and has re-keyed it since. This start then
        opens the real key (a hit) instead of building it a second time."""
        for path, stamp, _ in self.shards:
            now, digest = CONTENT_HASH_MEMO.known(path, self.writable.memo_file)
            if digest is None or now != list(stamp):
                return False
        return True

    def real_key(self, digests: list[str]) -> CacheKey:
        shards = [shard_identity(path, stamp, d) for (path, stamp, _), d in zip(self.shards, digests)]
        return cache_key(base_identity_of(shards), *self.rest)


def plan_fold(vaults: list, shard_paths: list[str], adapters: list[dict], target_dtype, merge_policy: str):
    """A :class:`Fold` when this start should fold, else None: every shard's digest is
    memoised (the key is known at once), no root can be built in, or some root holds a
    complete combination that hashing first may find to be this one."""
    writable = next((v for v in vaults if not v.read_only), None)
    if writable is None or not shard_paths:
        return None
    shards, inputs = _shards_and_inputs(writable, shard_paths, (adapters, target_dtype, merge_policy))
    if all(known is not None for _, _, known in shards):
        return None
    for vault in vaults:
        if any(c.complete and same_but_base_digests(c.inputs, inputs) for c in vault.combinations()):
            return None
    return Fold(writable, vaults, shards, inputs, (adapters, target_dtype, merge_policy))


def _shards_and_inputs(writable, shard_paths: list[str], rest: tuple) -> tuple[list, dict]:
    """``([(path, stamp, memoised digest or None)], the key's inputs but the base's digests)``."""
    shards = []
    for path in shard_paths:
        resolved = os.path.realpath(os.fspath(path))
        shards.append((resolved, *CONTENT_HASH_MEMO.known(resolved, writable.memo_file)))
    listed = [{"path": p, "size": stamp[2], "mtime_ns": stamp[3]} for p, stamp, _ in shards]
    return shards, key_inputs({"shards": listed}, *rest)


def wait_for_a_folded_build(vaults: list, shard_paths: list[str], rest: tuple) -> None:
    """Wait while another start builds this combination under its provisional key.

    That start folded the hash of this base and finished it (its digests are memoised,
    which is how this start knows them), but it names its build by the real key only
    once every layer is sealed: opening the real key meanwhile would build every layer a
    second time beside it. So where the provisional key's lock is held, this start waits
    for it; the combination is then under its real key, and this start maps it."""
    writable = next((v for v in vaults if not v.read_only), None)
    if writable is None or not shard_paths:
        return
    shards, inputs = _shards_and_inputs(writable, shard_paths, rest)
    key = provisional_key(inputs, [stamp for _, stamp, _ in shards])
    wait_sealed(os.path.join(writable.cache, key.hex))  # built in this process, and sealing behind its start
    path = lock_path(writable.cache, key.hex)
    if not os.path.exists(path) or not lock_is_held(path, shared_too=False):
        return
    say(f"{writable.label} {key.hex[:12]}: another start is building this combination while it hashes the "
        "base; waiting for it, then using what it built")
    lock = KeyLock(path)
    if lock.acquire_within(exclusive=False):  # granted once the builder has re-keyed and let go
        lock.release_and_remove_if_alone()
    else:  # bounded: the plain open below waits for, or works around, whoever holds it
        say(f"{writable.label} {key.hex[:12]}: still held by {describe_holders(lock_holders(path))}; going on")


class FoldedSession:
    """A provisional :class:`~hostmem.vault.session.VaultSession` while the base is hashed
    beside its build; once sealed, named by its real key (``key``, ``vault``: where the
    combination is now). Otherwise it is the session it wraps."""

    def __init__(self, session, fold: Fold, hasher: BaseHasher, cursor: BuildCursor, positions: dict):
        self._session, self._fold, self._hasher, self._cursor = session, fold, hasher, cursor
        self._positions = positions
        self._failed = False
        self._digests: list[str] | None = None  # known in the start of a build sealed behind it
        self.key, self.vault = session.key, session.vault
        session.after_seal = self._after_seal

    def __getattr__(self, name):
        return getattr(self._session, name)

    def in_file_order(self, targets: list) -> list:
        """``targets`` sorted by where their base starts in the shards, so that the build
        reads the base in the order the hasher does."""
        ranked = {name: at for name, at in self._positions.items() if at is not None}
        return sorted(targets, key=lambda t: ranked.get(t.name, float("inf")))

    def put_data(self, name, *args, **kwargs):
        self._cursor.advance(self._positions.get(name))
        return self._session.put_data(name, *args, **kwargs)

    def put(self, name, *args, **kwargs):
        self._cursor.advance(self._positions.get(name))
        return self._session.put(name, *args, **kwargs)

    @property
    def layers(self) -> dict:
        """The sealed layers (a failed build's stay for a build with the same provisional
        key to resume; none once its folder is gone)."""
        return self._session.layers if os.path.isdir(os.path.join(self.vault.cache, self.key)) else {}

    def _after_seal(self, session) -> None:
        """Under the provisional key's lock, after the seal: finish the hash, re-key.

        A build that failed (or was interrupted) stops its hasher where it is: reading
        the rest of the base would hold the exit up. Its sealed layers are re-keyed where
        the hash was done already, else kept, marked resumable
        (:func:`hostmem.vault.provisional.is_resumable`)."""
        if self._digests is not None:  # known in the start, which may have gone on (sealed behind it)
            self._rekey(session, self._digests, name=not session.stats["sealed_behind"])
        elif not self._failed:
            self._cursor.release()
            try:
                digests = self._hasher.result()
            except BaseException as exc:
                if exc is self._hasher.error:  # the base changed while it was hashed: what was built from it goes
                    remove_tree(session.folder)
                    raise
                self._settle(session)  # interrupted while it waited for the hash (a signal)
                raise
            try:
                self._rekey(session, digests)
            except KeyboardInterrupt:  # before the re-key's deferred part (its lock), or held over it and raised
                with interrupts_deferred():  # as it ended: whole, its base known, left provisional it would be swept
                    if self.key == session.key:
                        self._rekey(session, digests, wait=False)
                raise
            return
        self._settle(session)

    def _settle(self, session) -> None:
        """A build that stops before the hash is done: its hasher stops where it is, and
        the sealed layers take their real key where it had finished (a provisional folder
        whose base is known would be swept as never resumed), else stay, resumable."""
        self._cursor.stop()
        self._hasher.join()
        if self._hasher.error is not None or None in self._hasher.digests:
            _keep_for_resume(session, self._fold.paths)
        else:
            self._rekey(session, self._hasher.digests)

    def _rekey(self, session, digests: list[str], wait: bool = True, name: bool = True) -> None:
        """Name the sealed combination by its real key, now that the base's digests are known
        (``wait``: for another process that holds the real key's lock, a bounded wait;
        ``name``: :attr:`key` and :attr:`vault` say where it is now, else they stay as the
        start reported them)."""
        real = self._fold.real_key(digests)
        vault = rekey(session.vault, session.key, real, self._fold.vaults, wait)
        if name:
            self.vault, self.key = vault, real.hex

    @property
    def seal_behind(self) -> bool:
        """Leaving the ``with`` after a whole build closes it behind (see :meth:`close`)."""
        return self._session.seal_behind

    @seal_behind.setter
    def seal_behind(self, behind: bool) -> None:
        self._session.seal_behind = behind  # its layers then wait unwritten as they are parked

    def close(self, behind: bool = False) -> None:
        """Seal, then name the build by its real key. ``behind``: the start waits for the
        hash only (the hasher is at most its window behind the build, and the pages it
        reads are the ones the build just read), so that :attr:`key` is the real one when
        this returns; the seal and the re-key go on in a thread of their own
        (:mod:`.behind`), which a second session in this process on either key waits for.
        A hash that fails or is interrupted closes here and now, as without ``behind``."""
        if not behind or self._failed:
            self._session.close()
            return
        self._cursor.release()
        try:
            digests = self._hasher.result()
        except BaseException as exc:
            self._failed = exc is not self._hasher.error  # interrupted while it waited: the layers stay
            self._session.close()
            raise
        real = self._fold.real_key(digests)
        self._digests, self.key = digests, real.hex
        self._session.close(behind=True, also_as=(os.path.join(self._fold.writable.cache, real.hex),))

    def __enter__(self) -> "FoldedSession":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._failed = self._failed or exc_type is not None
        self.close(behind=self.seal_behind and not self._failed)


def _keep_for_resume(session, paths: list[str]) -> None:
    """Mark a failed build's sealed layers resumable; a folder with none goes."""
    try:
        if os.path.isdir(session.folder) and read_manifest(session.folder) is not None:
            mark_provisional(session.folder, session.key, paths, resumable=True)
            return
    except (OSError, ValueError):  # no room for the marker, or no readable seal: nothing to resume
        pass
    remove_tree(session.folder)
