"""Each base shard as its key names it, checked again before a layer built from it is sealed.

The key names a base by its shards' content digests, taken from the files as their
stamps then were (size and mtime, beside the digest in the key's inputs; a folded build's
provisional key lists them before the hash). The build reads the base's weights through
their mapping, which sees a write into the file (``cp`` over it, ``rsync --inplace``): a
layer summed after such a write would be sealed under the key of the bytes before it, and
served to every later start on those bytes. A writer changes mtime before it changes a
byte, so a layer whose check passes after its sum was summed from the bytes the key names.
A shard renamed over (another inode at the path) is refused too: the start cannot tell
the file it mapped from the one its key named once the path names another. The whole
stamp is compared, ctime too: whoever can write the file can put its mtime back.
"""

from __future__ import annotations

import os

from hostmem.errors import InputError

from ..targets.layer_target import AddressSpace, LayerTarget
from .base_shards import mapped_file

__all__ = ["base_reads", "check_base_unchanged"]


def base_reads(targets: list[LayerTarget], session) -> list[tuple[str, list[int]]]:
    """``(path, stamp the key names)`` of each base shard the ``targets`` are mapped views of
    and the key of ``session`` (a vault session) lists; weights that are no view of a
    listed shard (a heap model's, checked against ``base_files`` when keyed) are not
    re-read, so not checked. The stamp is the whole one (device, inode, size, mtime, ctime)
    the shard's digest was taken at: a folded build's provisional key lists them, and a
    real key's digest is the digest memo's for the file as it is now or the file is not
    the one the key names (refused at once). A user who can write the file can put its
    mtime back, never its ctime."""
    inputs = getattr(session, "inputs", None)
    base = inputs.get("base") if isinstance(inputs, dict) else None
    listed = {}
    for shard in (base.get("shards") or []) if isinstance(base, dict) else []:
        if isinstance(shard, dict) and isinstance(shard.get("path"), str):
            listed[os.path.realpath(shard["path"])] = shard
    if not listed:
        return []
    provisional = (inputs.get("provisional") or {}).get("stamps") if isinstance(inputs.get("provisional"), dict) else None
    space, reads = AddressSpace(), {}
    for target in targets:
        path = mapped_file(target, space) if target.current.device.type == "cpu" else None
        real = os.path.realpath(path) if path is not None else None
        if real in listed and real not in reads:
            area = space.area_of(target.current)
            reads[real] = (real, _keyed_stamp(real, area.inode, listed[real], provisional, session))
    return list(reads.values())


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


def check_base_unchanged(reads: list[tuple[str, list[int]]]) -> None:
    """Refuse when a shard of ``reads`` (:func:`base_reads`) is not the file the key named any more."""
    from hostmem.vault.content_hash import stamp_of

    for path, keyed in reads:
        try:
            now = stamp_of(os.stat(path))
        except OSError:
            _refuse(path, "it cannot be read any more")
        if now[:2] != keyed[:2]:
            _refuse(path, "another file was put at its path")
        if now != keyed:
            _refuse(path, "it was written")


def _refuse(path: str, why: str) -> None:
    raise InputError(
        f"base checkpoint {path}: changed since this merge keyed it ({why}); the layers built from it would not "
        "be the merge of the bytes the cache keys them by, so the merge stops (the layers sealed before stay, "
        "and are right). Reload the model once the file is written, and start again"
    )
