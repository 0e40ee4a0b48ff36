"""Each base shard as its key names it, checked again before a layer built from it is sealed.

The key names a base by its shards' content digests, taken from the files as their
stamps then were (size and mtime, beside the digest in the key's inputs; a folded build's
provisional key lists them before the hash). The build reads the base's weights through
their mapping, which sees a write into the file (``cp`` over it, ``rsync --inplace``): a
layer summed after such a write would be sealed under the key of the bytes before it, and
served to every later start on those bytes. A writer changes mtime before it changes a
byte, so a layer whose check passes after its sum was summed from the bytes the key names.
A shard renamed over (another inode at the path) is refused too: the start cannot tell
the file it mapped from the one its key named once the path names another.
"""

from __future__ import annotations

import os

from hostmem.errors import InputError

from ..targets.layer_target import AddressSpace, LayerTarget
from .base_shards import mapped_file

__all__ = ["base_reads", "check_base_unchanged"]


def base_reads(targets: list[LayerTarget], inputs: dict) -> list[tuple[str, int, list[int]]]:
    """``(path, inode mapped, [size, mtime_ns] the key names)`` of each base shard the
    ``targets`` are mapped views of and the key's ``inputs`` (a session's) list; weights
    that are no view of a listed shard (a heap model's, checked against ``base_files``
    when keyed) are not re-read, so not checked."""
    base = inputs.get("base") if isinstance(inputs, dict) else None
    listed = {}
    for shard in (base.get("shards") or []) if isinstance(base, dict) else []:
        if isinstance(shard, dict) and isinstance(shard.get("path"), str):
            listed[os.path.realpath(shard["path"])] = [shard.get("size"), shard.get("mtime_ns")]
    if not listed:
        return []
    space, reads = AddressSpace(), {}
    for target in targets:
        path = mapped_file(target, space) if target.current.device.type == "cpu" else None
        real = os.path.realpath(path) if path is not None else None
        if real in listed and real not in reads:
            reads[real] = (real, space.area_of(target.current).inode, listed[real])
    return list(reads.values())


def check_base_unchanged(reads: list[tuple[str, int, list[int]]]) -> None:
    """Refuse when a shard of ``reads`` (:func:`base_reads`) is not the file the key named any more."""
    for path, inode, keyed in reads:
        try:
            st = os.stat(path)
        except OSError:
            _refuse(path, "it cannot be read any more")
        if st.st_ino != inode:
            _refuse(path, "another file was put at its path")
        if [st.st_size, st.st_mtime_ns] != keyed:
            _refuse(path, "it was written")


def _refuse(path: str, why: str) -> None:
    raise InputError(
        f"base checkpoint {path}: changed since this merge keyed it ({why}); the layers built from it would not "
        "be the merge of the bytes the cache keys them by, so the merge stops (the layers sealed before stay, "
        "and are right). Reload the model once the file is written, and start again"
    )
