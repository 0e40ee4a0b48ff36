"""Each adapter file as it was when a merge read it, checked again where that matters.

A merge maps an adapter when it plans its targets, keys the combination by the content
digest of the file at the path later, and reads the values through the mapping while it
builds. A file replaced in between (a download renamed over it, ``cp`` or ``rsync
--inplace`` writing into it) would have the merge of one version stored under the key of
the other, and every later start would be served it. So the stamp of the file the
mapping holds (device, inode, size, mtime, ctime: what the cache's digests are memoised
by) is kept when it is read, and the file at the path must still have it when the key
is made and before each layer built from it is sealed. A writer changes mtime before it
changes a byte, so a layer whose check passes after its sum was summed from the bytes
its key names.
"""

from __future__ import annotations

import os

from hostmem.vault.content_hash import stamp_of
from .spec import AdapterError

__all__ = ["check_read_whole", "check_unchanged", "keyed", "read_as", "reads_of", "remember"]

_READ: dict[str, list[int]] = {}  # real path -> stamp of the file as its latest read found it
_KEYED: dict[str, list[int]] = {}  # real path -> stamp of the file the latest key was made from


def remember(path: str, st: os.stat_result) -> None:
    """Keep ``st`` (an fstat of the descriptor the file was read from) as ``path``'s stamp."""
    _READ[os.path.realpath(path)] = stamp_of(st)


def keyed(path: str, identity: dict) -> None:
    """Keep the stamp of the file at ``path`` as the one a key was just made from, whose
    ``identity`` (:func:`hostmem.vault.identity.adapter_identity`) records its size and mtime;
    refused when the file changed while the identity was taken."""
    real = os.path.realpath(path)
    stamp = _stamp_now(path)
    if stamp is None or [stamp[2], stamp[3]] != [identity.get("size"), identity.get("mtime_ns")]:
        _refuse(path, "it changed while its digest was taken")
    _KEYED[real] = stamp


def read_as(path: str) -> list[int] | None:
    """The stamp of ``path`` as this process last read it (taken by a read's values check
    right after the read)."""
    return _READ.get(os.path.realpath(path))


def check_unchanged(reads) -> None:
    """Refuse when a file of ``reads`` (``(path, stamp as read)`` pairs; a stamp of None is
    not checked) is not the file that was read any more, or not the file its key was made from."""
    for path, read in reads:
        if read is None:
            continue
        now, key = _stamp_now(path), _KEYED.get(os.path.realpath(path))
        if now is None:
            _refuse(path, "it cannot be read any more")
        if now != read:
            _refuse(path, "it was replaced" if now[:2] != read[:2] else "it was written")
        if key is not None and key != read:
            _refuse(path, "the file its key was made from was replaced or written before it was read again")


def check_read_whole(path: str, before: os.stat_result) -> None:
    """Refuse when ``path`` is not the file it was (``before``) once a read by path ended."""
    now = _stamp_now(path)
    if now != stamp_of(before):
        _refuse(path, "it cannot be read any more" if now is None else "it was written or replaced while it was read")


def _stamp_now(path: str) -> list[int] | None:
    try:
        return stamp_of(os.stat(path))
    except OSError:
        return None


def _refuse(path: str, why: str) -> None:
    raise AdapterError(
        f"adapter {path}: changed since this merge read it ({why}); the layers built from it would not be "
        "the merge of the bytes the cache keys them by, so the merge stops. Start again once the file is written"
    )


def reads_of(checks) -> list[tuple[str, list[int] | None]]:
    """``(path, stamp as read)`` of each distinct values check of ``checks`` (None skipped)."""
    seen: dict[int, tuple] = {}
    for check in checks:
        if check is not None and id(check) not in seen:
            seen[id(check)] = (check.path, getattr(check, "read_as", None))
    return list(seen.values())
