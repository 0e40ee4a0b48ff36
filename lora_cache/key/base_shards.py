"""Which checkpoint shards hold a merge's base weights: the base part of its cache key.

Split from :mod:`lora_cache.orchestrate`: the key covers only the shards holding the
targets, found from the mappings the weights are views of, or from the headers of the
shards a caller names.
"""

from __future__ import annotations

import math
import os

from hostmem.errors import InputError
from hostmem.safetensors.header import read_header

from ..targets.layer_target import AddressSpace, LayerTarget

__all__ = ["base_positions", "base_shards", "changed_in_memory", "differ_from_files", "header_matches", "mapped_file",
           "replaced_files", "unkeyed_reason"]

_COMPARE = 8 << 20  # bytes compared at a time against the file


def mapped_file(target: LayerTarget, space: AddressSpace) -> str | None:
    """The file the target's base weight is a mapped view of, or None."""
    area = space.area_of(target.current)
    path = area.path if area is not None and area.is_file else None
    if path is None or not path.startswith("/") or path.endswith(" (deleted)"):
        return None
    return path


def changed_in_memory(targets: list[LayerTarget], space: AddressSpace) -> list[str]:
    """Names of the targets whose bytes are no longer their checkpoint's, though they are
    still views of its mapping.

    A private file mapping (safetensors' own loader, diffusers' default load) is
    writable: a write copies the page (diffusers' ``fuse_lora`` sums into the weight
    where it lies; so does any ``param.data`` edit), and the weight keeps naming the
    file. The key names a base by its file, so such a weight would be served the file's
    merge, its change lost, or its merge built under the clean file's key for every
    later start. A read-only mapping cannot change, and a weight none of whose pages was
    copied is the file's; where pages were copied (a neighbour's write copies a page it
    shares), the weight's bytes are compared with the file's at the same offsets. A file
    that cannot be read to compare counts as changed.
    """
    changed = []
    for target in targets:
        tensor = target.current
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            continue
        area = space.area_of(tensor)
        path = mapped_file(target, space)
        if path is None or area.is_shared or "w" not in area.perms or not space.private_copies(tensor):
            continue
        if not _same_as_file(tensor, path, area.offset + tensor.data_ptr() - area.start):
            changed.append(target.name)
    return changed


def replaced_files(targets: list[LayerTarget], space: AddressSpace) -> list[str]:
    """Names of the targets that are views of a file no longer at its path: removed, or
    replaced (a new checkpoint renamed over it, as downloaders and rsync land one). The key
    would hash whatever is at the path now (given as ``base_files``): another file's merge
    under its key, served to every later start on it."""
    replaced, inodes = [], {}  # path -> the inode there now: one stat a file, not one a layer
    for target in targets:
        tensor = target.current
        area = space.area_of(tensor) if tensor.device.type == "cpu" else None
        if area is None or not area.is_file or not (area.path or "").startswith("/"):
            continue
        if area.path not in inodes:
            try:
                inodes[area.path] = None if area.path.endswith(" (deleted)") else os.stat(area.path).st_ino
            except OSError:
                inodes[area.path] = None
        if inodes[area.path] != area.inode:
            replaced.append(target.name)
    return replaced


def unkeyed_reason(host: list[LayerTarget], base_files: list[str] | None) -> str | None:
    """Why these weights cannot be keyed by the checkpoint they are views of, or that
    ``base_files`` names, in words (the merge is then summed in place, on top of what the
    model holds), or None."""
    space = AddressSpace()
    for names, what in ((replaced_files(host, space), "are views of a checkpoint file removed or replaced since "
                         "they were loaded"),
                        (changed_in_memory(host, space), "differ from the checkpoint file they are mapped from: "
                         "changed in memory since loading, as by a LoRA fused in place"),
                        (differ_from_files(host, space, base_files), "differ from their tensors in base_files (cast "
                         "to their dtype): loaded from another checkpoint, or changed in memory since loading")):
        if names:
            return (f"{len(names)} weight(s) ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) {what}; "
                    "the cache knows a base by its file, so this merge is summed in place, on top of what the "
                    "model holds (reload the model to use the cache)")
    return None


def _same_as_file(tensor, path: str, offset: int) -> bool:
    from hostmem.safetensors.mapping import tensor_bytes

    held = tensor_bytes(tensor)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        for at in range(0, len(held), _COMPARE):
            want = held[at : at + _COMPARE]
            if os.pread(fd, len(want), offset + at) != want:
                return False
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def differ_from_files(targets: list[LayerTarget], space: AddressSpace, base_files: list[str] | None) -> list[str]:
    """Names of the targets held in memory of their own (loaded copied: ``from_pretrained``
    with a cast, a heap model) whose bytes are not their tensor's in ``base_files``, as
    the loader would hold it (cast to the weight's dtype), checked on one row each.

    Such a weight is keyed by the shard the header names, not by its own bytes: a model
    loaded from another checkpoint than the one named, or with a LoRA fused into it in
    place, would be served that shard's merge (its own change lost), or build its merge
    under the shard's key for every later start. A row of each (a 1-D weight whole; any
    strides: transposed or channels-last storage holds the same values) is enough to catch
    a whole other checkpoint or a dense update (a fused LoRA changes every row); an edit of
    some rows only is not seen. A weight whose tensor no given shard names is not checked.
    """
    if not base_files:
        return []
    held = [t for t in targets if t.current.device.type == "cpu" and t.current.dim()
            and not getattr(space.area_of(t.current), "is_file", False)]
    if not held:
        return []
    found = header_matches(held, [os.path.realpath(os.fspath(p)) for p in base_files])
    changed, fds = [], {}
    try:
        for target in held:
            match = found.get(target.name)
            if match is not None and not _row_matches(target.current, *match, fds):
                changed.append(target.name)
    finally:
        for fd in fds.values():
            os.close(fd)
    return changed


def _row_matches(tensor, path: str, data_offset: int, info, fds: dict) -> bool:
    """Whether the middle row of ``tensor`` (its values, whatever its strides; a 1-D tensor
    whole) is that row of the file's tensor, cast to its dtype."""
    import torch

    if not tensor.numel():
        return True
    rows = tensor.shape[0] if tensor.dim() > 1 else 1
    per_row = tensor.numel() // rows
    width = per_row * (info.nbytes // max(1, math.prod(info.shape)))
    row = rows // 2
    try:
        if path not in fds:
            fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        raw = os.pread(fds[path], width, data_offset + info.begin + row * width)
    except OSError:
        return False
    if len(raw) != width:
        return False
    stored = torch.frombuffer(bytearray(raw), dtype=info.torch_dtype).to(tensor.dtype)
    mine = tensor.reshape(rows, per_row)[row]
    return bytes(stored.view(torch.uint8).numpy()) == bytes(mine.contiguous().view(torch.uint8).numpy())


def header_matches(targets: list[LayerTarget], base_files: list[str]) -> dict:
    """Target name -> ``(shard, data offset, TensorInfo)`` of the one tensor of the same shape
    its name (up to wrapper prefixes, as :func:`_shards_by_header` matches) names."""
    index, found = _header_index(base_files), {}
    for target in targets:
        candidates = _candidates(target, index)
        if len({(c[0], c[2].name) for c in candidates}) == 1:
            found[target.name] = candidates[0]
    return found


def _header_index(base_files: list[str]) -> tuple[dict, dict]:
    """``(exact, ending)``: tensor name, and every dotted suffix of one, -> ``(shard, data
    offset, TensorInfo)`` of each tensor in ``base_files`` so named."""
    exact: dict[str, list] = {}
    ending: dict[str, list] = {}
    for path in base_files:
        header = read_header(path)
        for name, info in header.tensors.items():
            exact.setdefault(name, []).append((path, header.data_offset, info))
            for suffix in _dotted_suffixes(name):
                ending.setdefault(suffix, []).append((path, header.data_offset, info))
    return exact, ending


def _candidates(target: LayerTarget, index: tuple[dict, dict]) -> list:
    """The tensors of :func:`_header_index` that may be ``target``: the same shape, and the same
    name up to wrapper prefixes on either side (``dit.blocks.0.w`` / ``model.blocks.0.w`` / ``blocks.0.w``)."""
    exact, ending = index
    shape = tuple(target.current.shape)
    shorter = [c for suffix in _dotted_suffixes(target.name)[1:] for c in exact.get(suffix, [])]
    return [c for c in ending.get(target.name, []) + shorter if tuple(c[2].shape) == shape]


def _dotted_suffixes(name: str) -> list[str]:
    """``a.b.c`` -> ``["a.b.c", "b.c", "c"]``."""
    parts = name.split(".")
    return [".".join(parts[i:]) for i in range(len(parts))]


def _shards_by_header(targets: list[LayerTarget], base_files: list[str]) -> set[str]:
    """The given shards whose headers hold the targets (:func:`_candidates`).

    When a target is found in none of them (renamed on load, say), every given shard is
    kept: the key then covers more than it needs, never less.
    """
    index, found = _header_index(base_files), set()
    for target in targets:
        holders = {c[0] for c in _candidates(target, index)}
        if not holders:
            return set(base_files)
        found |= holders
    return found


def base_shards(targets: list[LayerTarget], base_files: list[str] | None, space: AddressSpace) -> list[str]:
    """The checkpoint shards that hold the targets' base weights: the base part of the key.

    Only those shards decide the merged bytes, so only they enter the key, however the
    merge learns of them, and every way gives the same set: a weight that is a view of a
    mapped file (``hostmem.load_readonly``, safetensors' own mmap, ``hostmem lora
    merge``) names its shard itself; for the others, ``base_files`` (every shard of the
    checkpoint will do) is narrowed to the shards whose headers hold them. A shard
    without targets (the norms, the embeddings) may change without losing the cache.
    """
    files, unplaced = set(), []
    for target in targets:
        path = mapped_file(target, space)
        if path is None:
            unplaced.append(target)
        else:
            files.add(path)
    if unplaced and base_files is None:
        names = [t.name for t in unplaced]
        raise InputError(
            f"cannot tell which checkpoint {len(names)} weight(s) come from ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''}): they are not views of a mapped file. Pass "
            "base_files=[the .safetensors shards the model was loaded from], or enabled=False to merge in place"
        )
    if unplaced:
        files |= _shards_by_header(unplaced, [os.path.realpath(os.fspath(p)) for p in base_files])
    return sorted(files)


def base_positions(targets: list[LayerTarget], shards: list[str], space: AddressSpace) -> dict[str, int | None]:
    """Where each target's base starts in ``shards`` laid end to end (None where it is not
    a view of one of them): the order a folded build reads them in (:mod:`hostmem.vault.fold`)."""
    starts, at = {}, 0
    for path in shards:
        starts[path] = at
        at += os.path.getsize(path)
    positions = {}
    for target in targets:
        area = space.area_of(target.current)
        path = mapped_file(target, space)
        real = os.path.realpath(path) if path is not None else None
        positions[target.name] = (None if real not in starts else
                                  starts[real] + area.offset + target.current.data_ptr() - area.start)
    return positions
