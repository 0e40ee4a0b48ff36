"""Each base shard as its key names it, checked again before a layer built from it is sealed.

The key names a base by its shards' content digests, taken from the files as their
stamps then were (size and mtime, beside the digest in the key's inputs; a folded build's
provisional key lists them before the hash). The build reads the base's weights through
their mapping, which sees a write into the file (``cp`` over it, ``rsync --inplace``): a
layer summed after such a write would be sealed under the key of the bytes before it, and
served to every later start on those bytes. A writer changes mtime before it changes a
byte, so a layer whose check passes after its sum was summed from the bytes the key names.
Each shard is held open from the build's start and checked by that descriptor. The whole
stamp is compared, ctime too: whoever can write the file can put its mtime back, so a
mode or a link changed during a build stops it as well, as does the file's removal (a
file renamed over its path unlinks it: whoever did may have written it first), each
named as what it may be.
"""

from __future__ import annotations

import os

from hostmem.errors import InputError

from ..targets.layer_target import AddressSpace, LayerTarget
from .base_shards import mapped_file

__all__ = ["BaseReads", "base_reads"]


class BaseReads:
    """The base shards a build reads, each held open (the very file its weights are mapped
    from, whatever is renamed over its path later) with the stamp its key names."""

    def __init__(self, held: list | None = None):
        self.held: list[tuple[str, int, list[int] | None]] = held or []  # (path, descriptor, stamp keyed)

    def check(self) -> None:
        """Refuse when a shard is not the file the key named any more (see the module)."""
        from hostmem.vault.content_hash import stamp_of

        for path, fd, keyed in self.held:
            st = os.fstat(fd)
            now = stamp_of(st)
            if now[2:4] != keyed[2:4]:
                _refuse(path, "it was written")
            if now != keyed and st.st_nlink == 0:  # unlinked: its ctime moved with it
                _refuse(path, "it was removed, or another file renamed over it: whoever did may have written it "
                              "first")
            if now != keyed:
                _refuse(path, "its inode changed: written with its mtime put back, or given another mode or "
                              "link; the merge cannot tell which")

    def close(self) -> None:
        for _, fd, _ in self.held:
            os.close(fd)
        self.held = []


def base_reads(targets: list[LayerTarget], session) -> BaseReads:
    """The base shards the ``targets`` are mapped views of and the key of ``session`` (a vault
    session) lists, held open with the stamp the key names (:class:`BaseReads`); weights that
    are no view of a listed shard (a heap model's, checked against ``base_files`` when keyed)
    are not re-read, so not checked. The stamp is the whole one (device, inode, size,
    mtime, ctime) the shard's digest was taken at: a folded build's provisional key lists
    them, and a real key's digest is the digest memo's for the file as it is now or the
    file is not the one the key names (refused at once). A user who can write the file can
    put its mtime back, never its ctime."""
    inputs = getattr(session, "inputs", None)
    base = inputs.get("base") if isinstance(inputs, dict) else None
    listed = {}
    for shard in (base.get("shards") or []) if isinstance(base, dict) else []:
        if isinstance(shard, dict) and isinstance(shard.get("path"), str):
            listed[os.path.realpath(shard["path"])] = shard
    reads = BaseReads()
    if not listed:
        return reads
    marked = inputs.get("provisional")
    provisional = marked.get("stamps") if isinstance(marked, dict) else None
    space, seen = AddressSpace(), set()
    try:
        for target in targets:
            path = mapped_file(target, space) if target.current.device.type == "cpu" else None
            real = os.path.realpath(path) if path is not None else None
            if real not in listed or real in seen:
                continue
            seen.add(real)
            inode = space.area_of(target.current).inode
            try:
                fd = os.open(real, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                _refuse(real, "it cannot be read any more")
            reads.held.append((real, fd, None))
            if os.fstat(fd).st_ino != inode:
                _refuse(real, "another file was put at its path since the model mapped it")
            reads.held[-1] = (real, fd, _keyed_stamp(real, inode, listed[real], provisional, session))
    except BaseException:
        reads.close()
        raise
    return reads


def _keyed_stamp(path: str, inode: int, shard: dict, provisional, session) -> list[int]:
    """The whole stamp of ``path`` the key's digest of it was taken at (see :func:`base_reads`)."""
    from hostmem.vault.content_hash import CONTENT_HASH_MEMO

    if provisional is not None:
        found = [list(s) for s in provisional if isinstance(s, (list, tuple)) and len(s) == 5 and s[1] == inode]
        if len(found) == 1:
            return found[0]
    else:
        vault = getattr(session, "vault", None)
        try:
            stamp, digest = CONTENT_HASH_MEMO.known(path, getattr(vault, "memo_file", None))
        except OSError:
            _refuse(path, "it cannot be read any more")
        if digest is not None and digest == shard.get("digest") and stamp[1] == inode:
            return stamp
    _refuse(path, "it was written or replaced since its digest was taken")



def _refuse(path: str, why: str) -> None:
    raise InputError(
        f"base checkpoint {path}: changed since this merge keyed it ({why}); the layers built from it would not "
        "be the merge of the bytes the cache keys them by, so the merge stops (the layers sealed before stay, "
        "and are right). Reload the model once the file is written, and start again"
    )
