"""Content hashes of whole files (base shards, adapters), memoised by inode and times.

The key of a merged combination must change whenever any byte of its inputs does,
whatever the timestamps say (``cp -p``, ``rsync -t``, ``tar`` and image builders put
old mtimes back), and must not change when the bytes do not (a ``touch``, a copy to
another folder, an image unpacked on another host). Only the content can do both, so
every input file is identified by a hash of all of it.

Which hash: it must keep up with the disk, since a first start on a copied base reads
every byte once. sha256 runs at 1.1-1.6 GiB/s per core even with the CPU's SHA
instructions, below a virtio disk's 1.4-2.3 GiB/s cold read on the development
machines; BLAKE3 (what ccache and sccache use) ran at 4.1 GiB/s on one core there
(its tree could spread one update over more cores, where a disk outruns one). The digest names its algorithm
(``blake3:<hex>``), so nothing made with another hash (an older memo, a key) is ever
taken for it; where the ``blake3`` module cannot be imported the same reader feeds
hashlib's sha256 and digests say ``sha256:``.

How it reads: one thread fills buffers with ``preadv`` while the caller hashes the
one filled before (both release the GIL), and the file is advised sequential, so the
disk always has the next requests queued while a core hashes, and the hash only waits
where the disk is slower than it. See :func:`file_digest` for what was measured
against the alternatives.

Re-reading a 60 GB base at every start is out of the question, so a digest is
memoised by (device, inode, size, mtime_ns, ctime_ns): in this process, and across
processes in a JSON file under the cache root. ctime cannot be set from user space, so
a file rewritten in place with its old mtime put back is hashed again; a touched or
copied file is hashed once, then hits.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import mmap
import os
import queue
import threading
from collections.abc import Callable

from ..errors import InputError
from .durable import durable_write

__all__ = ["hash_name", "new_hasher", "file_digest", "read_chunks", "stamp_of", "ContentHashMemo", "CONTENT_HASH_MEMO",
           "forget_in_memo_file", "MEMO_NAME"]

_READ = 8 * 1024 * 1024
_HASH_READ = 1024 * 1024  # per buffer of the hash's reader (see file_digest)
_HASH_BUFFERS = 4
_HASH_AHEAD = 32 * 1024 * 1024  # asked of the kernel ahead of the reader (see file_digest)
_ADVICE_STEP = 8 * 1024 * 1024
_MEMO_ENTRIES = 4096  # the on-disk memo keeps the most recent ones
MEMO_NAME = "content_hashes.json"  # the on-disk memo, in a root's cache folder


def _fill(fd: int, view: memoryview, offset: int, end: int) -> int:
    """Read bytes from ``offset`` into ``view`` until it is full or ``end`` is reached."""
    want, got = min(len(view), end - offset), 0
    while got < want:
        n = os.preadv(fd, [view[got:want]], offset + got)
        if n == 0:
            raise OSError(f"file shrank while it was being read (at byte {offset + got})")
        got += n
    return got


def _hand_over(consume, view: memoryview, got: int) -> None:
    """``consume`` the first ``got`` bytes of ``view``; the slice is released even when
    ``consume`` raises (a traceback keeps its frame, and with it the slice, alive, and
    the mapping under it could not be closed)."""
    chunk = view[:got]
    try:
        consume(chunk)
    finally:
        chunk.release()


def _advise_ahead(fd: int, advised: int, upto: int) -> int:
    """Ask the kernel to read ``advised..upto`` of ``fd`` in (its read-ahead, in requests as
    large as the disk takes, while the reader copies what is in already); the new mark."""
    while advised < upto:
        try:
            os.posix_fadvise(fd, advised, _ADVICE_STEP, os.POSIX_FADV_WILLNEED)
        except (OSError, AttributeError):  # a filesystem that takes no advice: the reads still work
            return upto
        advised += _ADVICE_STEP
    return advised


def _read_behind(fd: int, start: int, end: int, views: list[memoryview], consume, gate=None, ahead: int = 0) -> None:
    """``consume`` each filled view in order while a second thread fills the next ones.

    The reader takes a free view, fills it, hands it over, and takes the next; the
    caller hands each view back once consumed. So the disk is never idle while the
    caller works, and the caller waits only for bytes the disk has not delivered yet.
    An error on either side stops both and is raised here.
    """
    free: queue.SimpleQueue = queue.SimpleQueue()
    filled: queue.SimpleQueue = queue.SimpleQueue()
    for view in views:
        free.put(view)

    def reader() -> None:
        offset = advised = start
        try:
            while offset < end and (view := free.get()) is not None:
                if gate is not None:
                    gate(min(offset + len(view), end))
                if ahead:
                    advised = _advise_ahead(fd, advised, min(end, offset + ahead))
                got = _fill(fd, view, offset, end)
                filled.put((view, got))
                offset += got
            filled.put(None)
        except BaseException as exc:  # handed to the caller, which raises it
            filled.put(exc)

    thread = threading.Thread(target=reader, name="hostmem-read-ahead", daemon=True)
    thread.start()
    try:
        while (item := filled.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            _hand_over(consume, *item)
            free.put(item[0])
    finally:
        free.put(None)  # a reader waiting for a view stops; one reading stops at its next view
        thread.join()


def read_chunks(
    fd: int, start: int, end: int, consume: Callable[[memoryview], None], buffers: int = 1, chunk: int = _READ,
    gate: Callable[[int], None] | None = None, ahead: int = 0,
) -> None:
    """Feed bytes ``start..end`` of ``fd`` to ``consume`` in chunks of up to ``chunk`` bytes,
    read into one anonymous mapping that goes back to the kernel at the end.

    With ``buffers`` > 1, a second thread reads ahead into the other buffers while
    ``consume`` runs (which must then release the GIL to gain anything). Not a fresh
    ``bytes`` per chunk: freed multi-MiB blocks stay in a thread's malloc arena as
    anonymous memory the process keeps; not a mapping of the file either: a file
    truncated meanwhile would kill the process with SIGBUS.

    ``gate(upto)``, where given, is called before each read with the offset the read
    will reach, and may block (a hash folded into a build paces itself to the build's
    reads: :mod:`hostmem.vault.fold`) or raise (to stop the read). ``ahead`` (with
    ``buffers`` > 1): bytes the kernel is asked to read in ahead of the reader.
    """
    size = min(chunk, max(end - start, 1))
    with mmap.mmap(-1, size * buffers) as memory:
        whole = memoryview(memory)
        views = [whole[i * size : (i + 1) * size] for i in range(buffers)]
        try:
            if buffers > 1:
                _read_behind(fd, start, end, views, consume, gate, ahead)
            while buffers == 1 and start < end:
                if gate is not None:
                    gate(min(start + len(views[0]), end))
                got = _fill(fd, views[0], start, end)
                _hand_over(consume, views[0], got)
                start += got
        finally:
            for view in views:
                view.release()
            whole.release()


@functools.cache
def hash_name() -> str:
    """``"blake3"``, or ``"sha256"`` where the ``blake3`` module is not installed.

    Asked without loading the module: a start whose digests are all memoised never
    imports it.
    """
    try:
        return "blake3" if importlib.util.find_spec("blake3") is not None else "sha256"
    except (ImportError, ValueError):  # a module that cannot be found or was blocked
        return "sha256"


def new_hasher():
    """A running hash, on one core (see :func:`file_digest`): BLAKE3, or hashlib's
    sha256 where the module cannot be imported (no wheel for this platform)."""
    try:
        import blake3
    except ImportError:
        return hashlib.sha256()
    return blake3.blake3()


def file_digest(path: str, gate: Callable[[int], None] | None = None) -> str:
    """The content digest of the whole file at ``path``: ``"<algorithm>:<hex>"``.

    Read by :func:`read_chunks`: a reader thread fills four 1 MiB buffers while this
    thread hashes, the file advised sequential (the kernel doubles its read-ahead), and
    the kernel asked to read :data:`_HASH_AHEAD` ahead of the reader (``WILLNEED``, in
    8 MiB steps): left to 1 MiB reads, the disk gets requests no larger than those, one
    at a time, and a virtio disk reading 2 GiB/s in 4 MiB requests gives the reader 1.5.
    Measured in eight interleaved rounds on 2 GiB from a cold page cache, hash rate / raw
    read of the same round, median: 0.88 without the advice, 1.29 with 32 MiB ahead,
    1.31 with 64 MiB (32 MiB kept: as fast, half the page cache ahead of the hash).
    Chosen by measurement on the 2-core development machine from a cold page cache
    (512 MiB-1 GiB, each hash against a raw read just before it, eight runs of 3-8
    rounds; with other work on the cores that virtual disk swung between 0.2 and 1.9
    GiB/s, so per-run medians of hash rate / read rate):

    - this reader: 0.77-2.17, 0.31-0.39 CPU s/GiB;
    - one thread alternating read and hash (the disk then relies on the kernel's
      read-ahead alone while that thread hashes or waits for a core): 0.51-1.42;
    - the same reader with three 16 MiB buffers: 0.36-1.04, 0.44-0.52 CPU s/GiB (48 MiB
      in flight leave the last-level cache, so the hash reads from memory what the
      reader just wrote);
    - BLAKE3's own ``update_mmap``: 0.25-1.32 and the least CPU (0.27-0.29 s/GiB, no
      copy), but it maps the file, and a shard truncated meanwhile would kill the
      process with SIGBUS;
    - BLAKE3 on every core (``max_threads=AUTO``): slower here, its threads compete
      with the reader and the rest of the machine; one core hashes 3.7-4.1 GiB/s from
      memory, above the disk.

    ``gate``: see :func:`read_chunks`.
    """
    hasher = new_hasher()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except (OSError, AttributeError):  # not Linux, or a filesystem that takes no advice
            pass
        read_chunks(fd, 0, os.fstat(fd).st_size, hasher.update, buffers=_HASH_BUFFERS, chunk=_HASH_READ, gate=gate,
                    ahead=_HASH_AHEAD)  # folded into a build, it then runs at most that much past its gate
    finally:
        os.close(fd)
    return f"{hasher.name}:{hasher.hexdigest()}"


def stamp_of(st: os.stat_result) -> list[int]:
    """What must be unchanged for a memoised digest (or a verification) to still hold."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _memo_key(stamp: list[int]) -> str:
    return f"{stamp[0]}:{stamp[1]}"


class ContentHashMemo:
    """Digests by (device, inode) with the stamp they were taken at; optionally on disk.

    ``computed`` and ``hits`` count what happened, so a start can show it did not rehash.
    """

    def __init__(self) -> None:
        self._digests: dict[str, tuple[list[int], str]] = {}
        self._lock = threading.Lock()
        self.computed = 0
        self.hits = 0

    def digest(self, path: str, memo_file: str | None = None) -> str:
        """The content digest of ``path``, from the memo when its stamp still matches."""
        stamp, known = self.known(path, memo_file)
        if known is not None:
            return known
        digest = file_digest(path)
        self.record(path, stamp, digest, memo_file)
        return digest

    def known(self, path: str, memo_file: str | None = None) -> tuple[list[int], str | None]:
        """``(stamp, digest)``: the file's stamp now, and its memoised digest while that
        stamp still matches (else None: the file must be hashed)."""
        stamp = stamp_of(os.stat(path))
        key = _memo_key(stamp)
        with self._lock:
            known = self._digests.get(key)
            if (known is None or list(known[0]) != stamp) and memo_file is not None:
                known = load_memo_file(memo_file).get(key)
            if known is None or list(known[0]) != stamp:
                return stamp, None
            self.hits += 1
            self._digests[key] = (stamp, known[1])
            return stamp, known[1]

    def record(self, path: str, stamp: list[int], digest: str, memo_file: str | None = None) -> None:
        """Remember ``digest`` of ``path``, hashed from the file as ``stamp`` describes it;
        refuse it when the file changed meanwhile (its digest would describe neither)."""
        if stamp_of(os.stat(path)) != stamp:
            raise InputError(f"{path}: changed while it was being hashed; start again once it is written")
        key = _memo_key(stamp)
        with self._lock:
            self.computed += 1
            self._digests[key] = (stamp, digest)
        if memo_file is not None:
            _store_in_memo_file(memo_file, key, stamp, digest)

    def clear(self) -> None:
        with self._lock:
            self._digests.clear()


CONTENT_HASH_MEMO = ContentHashMemo()


def load_memo_file(memo_file: str) -> dict:
    """Read the on-disk memo; a missing or damaged one is simply empty (it is a hint)."""
    from .safety import parse_json, read_trusted  # here: safety needs the procfs readers, a hash does not

    try:
        data = parse_json(read_trusted(memo_file))  # only a file of ours, in a folder only we write
        if data.get("hash") != hash_name():
            return {}
        return {k: (e["stamp"], e["digest"]) for k, e in data["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _store_in_memo_file(memo_file: str, key: str, stamp: list[int], digest: str) -> None:
    """Add one digest to the on-disk memo (atomic replace; a lost race only costs a rehash).

    A read-only root keeps no memo: the digest then lives in this process only.
    """
    entries = load_memo_file(memo_file)
    entries.pop(key, None)
    entries[key] = (stamp, digest)
    kept = list(entries.items())[-_MEMO_ENTRIES:]
    data = {"hash": hash_name(), "files": {k: {"stamp": s, "digest": d} for k, (s, d) in kept}}
    try:
        durable_write(memo_file, json.dumps(data, indent=1).encode())
    except OSError:
        pass


def forget_in_memo_file(memo_file: str, path: str) -> None:
    """Drop the on-disk memo's digest of the file at ``path`` (its bytes changed under a
    stamp that did not: ``hostmem cache verify --deep``), so the next start hashes it."""
    try:
        key = _memo_key(stamp_of(os.stat(path)))
    except OSError:
        return
    entries = load_memo_file(memo_file)
    if entries.pop(key, None) is None:
        return
    data = {"hash": hash_name(), "files": {k: {"stamp": s, "digest": d} for k, (s, d) in entries.items()}}
    durable_write(memo_file, json.dumps(data, indent=1).encode())
