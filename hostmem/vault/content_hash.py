"""Content hashes of whole files (base shards, adapters), memoised by inode and times.

The key of a merged combination must change whenever any byte of its inputs does,
whatever the timestamps say (``cp -p``, ``rsync -t``, ``tar`` and image builders put
old mtimes back), and must not change when the bytes do not (a ``touch``, a copy to
another folder, an image unpacked on another host). Only the content can do both, so
every input file is identified by a hash of all of it.

Which hash: it must keep up with the disk, since a first start on a copied base reads
every byte once. On the development machines (SHA-NI, 2 cores) hashlib's sha256 ran at
1.5 GiB/s per core, blake2b at 0.74, sha1 at 1.7 and md5 at 0.65, while a cold
sequential read of the same disk ran at 0.9 GiB/s: only sha256 (with the CPU's SHA
instructions) and sha1 keep up on one core, and sha1 is broken for collisions. A single
running sha256 cannot use a second core, so the file is hashed as a tree: the sha256 of
each :data:`PIECE_BYTES` piece, read and hashed by a pool of threads (hashlib and
``os.pread`` release the GIL), then one sha256 over the piece count, the file size and
the piece digests in order. On a page-cached file that runs at nearly the cores' sum;
``bench/bench_identity.py`` measures it against a raw read of the same file.

Re-reading a 60 GB base at every start is out of the question, so a digest is
memoised by (device, inode, size, mtime_ns, ctime_ns): in this process, and across
processes in a JSON file under the cache root. ctime cannot be set from user space, so
a file rewritten in place with its old mtime put back is hashed again; a touched or
copied file is hashed once, then hits.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import threading
from collections.abc import Callable

from .durable import durable_write, read_small

__all__ = ["PIECE_BYTES", "HASH_NAME", "file_digest", "read_chunks", "stamp_of", "ContentHashMemo", "CONTENT_HASH_MEMO"]

PIECE_BYTES = 64 * 1024 * 1024
HASH_NAME = "sha256-tree-64MiB"
_READ = 8 * 1024 * 1024
_MEMO_ENTRIES = 4096  # the on-disk memo keeps the most recent ones


def _threads() -> int:
    try:
        return max(1, min(8, len(os.sched_getaffinity(0))))
    except AttributeError:
        return max(1, min(8, os.cpu_count() or 1))


def read_chunks(fd: int, start: int, end: int, consume: Callable[[memoryview], None]) -> None:
    """Feed bytes ``start..end`` of ``fd`` to ``consume`` in chunks, read into one anonymous
    mapping that goes back to the kernel at the end.

    Not a fresh ``bytes`` per chunk: freed multi-MiB blocks stay in a thread's malloc
    arena as anonymous memory the process keeps; not a mapping of the file either: a
    file truncated meanwhile would kill the process with SIGBUS.
    """
    with mmap.mmap(-1, min(_READ, max(end - start, 1))) as buffer:
        view = memoryview(buffer)
        try:
            while start < end:
                got = os.preadv(fd, [view[: min(len(view), end - start)]], start)
                if got == 0:
                    raise OSError(f"file shrank while it was being read (at byte {start})")
                consume(view[:got])
                start += got
        finally:
            view.release()


def _piece_digest(fd: int, start: int, end: int) -> bytes:
    digest = hashlib.sha256()
    read_chunks(fd, start, end, digest.update)
    return digest.digest()


def _read_ahead(fd: int, start: int, end: int) -> None:
    """Ask the kernel to start reading ``start..end`` now, so the disk works while a core hashes."""
    try:
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
    except (OSError, AttributeError):  # not Linux, or a filesystem that takes no advice
        pass


def file_digest(path: str) -> str:
    """The tree sha256 of the whole file at ``path`` (see the module docstring), in hex."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        starts = range(0, size, PIECE_BYTES)
        from concurrent.futures import ThreadPoolExecutor  # not at import: `hostmem cache` starts light

        def piece(s: int) -> bytes:
            following = s + _threads() * PIECE_BYTES  # the piece this thread takes next
            if following < size:
                _read_ahead(fd, following, min(size, following + PIECE_BYTES))
            return _piece_digest(fd, s, min(size, s + PIECE_BYTES))

        for s in starts[: _threads()]:
            _read_ahead(fd, s, min(size, s + PIECE_BYTES))
        with ThreadPoolExecutor(_threads(), "hostmem-content-hash") as pool:
            pieces = list(pool.map(piece, starts))
    finally:
        os.close(fd)
    top = hashlib.sha256(f"{HASH_NAME}:{len(pieces)}:{size}:".encode())
    for piece in pieces:
        top.update(piece)
    return top.hexdigest()


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
        stamp = stamp_of(os.stat(path))
        key = _memo_key(stamp)
        with self._lock:
            known = self._digests.get(key)
            if (known is None or list(known[0]) != stamp) and memo_file is not None:
                known = load_memo_file(memo_file).get(key)
            if known is not None and list(known[0]) == stamp:
                self.hits += 1
                self._digests[key] = (stamp, known[1])
                return known[1]
        digest = file_digest(path)
        if stamp_of(os.stat(path)) != stamp:
            raise ValueError(f"{path}: changed while it was being hashed; start again once it is written")
        with self._lock:
            self.computed += 1
            self._digests[key] = (stamp, digest)
        if memo_file is not None:
            _store_in_memo_file(memo_file, key, stamp, digest)
        return digest

    def clear(self) -> None:
        with self._lock:
            self._digests.clear()


CONTENT_HASH_MEMO = ContentHashMemo()


def load_memo_file(memo_file: str) -> dict:
    """Read the on-disk memo; a missing or damaged one is simply empty (it is a hint)."""
    try:
        data = json.loads(read_small(memo_file))
        if data.get("hash") != HASH_NAME:
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
    data = {"hash": HASH_NAME, "files": {k: {"stamp": s, "digest": d} for k, (s, d) in kept}}
    try:
        durable_write(memo_file, json.dumps(data, indent=1).encode())
    except OSError:
        pass
