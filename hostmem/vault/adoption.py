"""Adoption: what a session may serve of a combination folder when it opens it.

Runs under the key's lock, so nobody writes meanwhile. Temporary files are leftovers
of a writer that died and go. Layers the manifest records must still have the size
and header it recorded; layer files it does not record (a build that was killed, or
a session that added layers and died before sealing) are adopted on their own
header, which carries their checksum. Then every layer's content is checked against
its checksum unless that is memoised (:mod:`.verification`): a layer that fails is
removed, named to the user with the reason, and rebuilt; it is never served. A
manifest that cannot be read, or layers of another shape or dtype than the model
asks for, drop the whole combination: it belongs to something else.

A sealed, complete manifest whose every layer the verification memo vouches for (the
file is the very one written or verified, unchanged since: same inode, size, mtime and
ctime, same checksum) is taken as it is, without reading the layer headers. Every
layer served carries the stamp it was verified at: ``get`` maps a file that still has
it at the data offset the manifest records, without reading its header either; a file
changed since (or a manifest of an older release, without offsets) has its header
read and checked against the manifest as it is mapped.
"""

from __future__ import annotations

import os
import stat

from hostmem.safetensors.header import SafetensorsError

from .anchor import listdir_in
from .durable import discard, fsync_dir, remove_tree
from .layer_file import LayerEntry, is_layer_file_name, layer_problem, read_layer_file
from .manifest import Manifest, ManifestError, inputs_problem, read_manifest
from .provisional import PROVISIONAL_WHY, is_provisional, is_resumable
from .safety import make_private_dir
from .verification import VerifiedMemo, check_layers, read_damage

__all__ = ["Adopted", "adopt", "drop_folder", "shape_dtype_problem"]


class Adopted:
    """What a folder held that can be served, and why it was dropped, if it was.

    A plain class, not a dataclass: every start with the cache imports this module, and
    a dataclass compiles its methods at import (about 1 ms on a small core).
    """

    def __init__(self, entries: dict[str, LayerEntry], manifest: Manifest | None, dropped: str | None = None,
                 resumed: int = 0, failed: dict[str, str] | None = None, memo: VerifiedMemo | None = None,
                 damaged: bool = False, vouched: bool = False):
        self.entries = entries  # tensor name -> entry, each with the stamp it was verified at
        self.manifest = manifest
        self.dropped = dropped
        self.resumed = resumed  # layer files found without a manifest entry (an interrupted build)
        self.failed = failed if failed is not None else {}  # tensor name -> why its file is not served
        self.memo = memo
        self.damaged = damaged  # `hostmem cache verify` had recorded damage here
        self.vouched = vouched  # sealed, complete, every layer vouched for by the memo: taken as sealed

    def __repr__(self) -> str:
        return (f"Adopted({len(self.entries)} layers, dropped={self.dropped!r}, resumed={self.resumed}, "
                f"failed={sorted(self.failed)}, vouched={self.vouched})")


def shape_dtype_problem(entry: LayerEntry, shape, dtype: torch.dtype) -> str | None:
    """Why ``entry`` is not the layer asked for (shape or dtype), or None."""
    if tuple(shape) != entry.shape or entry.torch_dtype != dtype:
        return (
            f"layer {entry.name!r} is cached as {list(entry.shape)} {entry.torch_dtype}, "
            f"but {list(shape)} {dtype} was asked for"
        )
    return None


def drop_folder(folder: str) -> None:
    """Empty a combination folder (it is about to be rebuilt); links are unlinked, not followed."""
    remove_tree(folder)
    make_private_dir(folder)
    fsync_dir(os.path.dirname(folder))


def _recorded(folder: str, manifest: Manifest) -> tuple[dict[str, LayerEntry], dict[str, str]]:
    """The manifest's layers whose files still have the recorded size and header, and
    why the others do not."""
    entries, failed = {}, {}
    for entry in manifest.layers.values():
        problem = layer_problem(folder, entry)
        if problem:
            failed[entry.name] = problem
        else:
            entries[entry.name] = entry
    return entries, failed


def _clear_name(path: str) -> None:
    """Whatever stands at a failed layer's name goes, a folder too: the layer's rebuild takes
    the name by a rename, which a folder there fails."""
    try:
        is_folder = stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return
    if is_folder:
        remove_tree(path)  # links inside are unlinked, never followed
    else:
        discard(path)


def _unrecorded(folder: str, known_files: set[str], writable: bool) -> dict[str, LayerEntry]:
    """Sealed layer files the manifest does not list (a build that did not get to seal)."""
    found = {}
    for name in sorted(listdir_in(folder)):
        if not is_layer_file_name(name) or name in known_files:
            continue
        path = os.path.join(folder, name)
        try:
            entry = read_layer_file(path)
        except (SafetensorsError, OSError):
            if writable:
                discard(path)  # never recorded, never valid: nothing to serve
            continue
        found[entry.name] = entry
    return found


def _expected_problem(entries: dict[str, LayerEntry], expected: dict | None) -> str | None:
    for name, (shape, dtype) in (expected or {}).items():
        entry = entries.get(name)
        problem = entry and shape_dtype_problem(entry, shape, dtype)
        if problem:
            return problem
    return None


def _dropped(folder: str, why: str, writable: bool) -> Adopted:
    if writable:
        drop_folder(folder)
    return Adopted({}, None, dropped=why)


def adopt(folder: str, expected: dict | None, writable: bool = True, inputs: dict | None = None) -> Adopted:
    """Read what ``folder`` holds that can be served, verified; drop what cannot.

    A read-only folder (``writable=False``) is only read: what fails is left there,
    and not served. A manifest whose recorded base digests differ from ``inputs``' is
    another combination's, and dropped. A provisional folder is never served (:mod:`.provisional`).
    """
    if is_provisional(folder) and not (writable and is_resumable(folder)):
        return _dropped(folder, PROVISIONAL_WHY, writable)
    try:
        manifest = read_manifest(folder)
    except ManifestError as exc:
        return _dropped(folder, str(exc), writable)
    mismatch = manifest is not None and inputs_problem(manifest, inputs or {})
    if mismatch:
        return _dropped(folder, mismatch, writable)
    damaged = read_damage(folder) is not None
    memo = VerifiedMemo(folder, trust=not damaged)
    vouched = _vouched(manifest, memo)
    if vouched:
        entries, failed = dict(manifest.layers), {}  # no header read: mapped at their recorded offsets
    else:
        entries, failed = _recorded(folder, manifest) if manifest else ({}, {})
    if writable:
        for name in failed:
            _clear_name(os.path.join(folder, manifest.layers[name].file))
    extra = _unrecorded(folder, {e.file for e in entries.values()}, writable)
    entries.update(extra)
    problem = _expected_problem(entries, expected)
    if problem:
        return _dropped(folder, problem, writable)
    bad = check_layers(folder, extra if vouched else entries, memo)  # the vouched ones were checked just now
    for name in bad:
        if writable:
            discard(os.path.join(folder, entries[name].file))
        del entries[name]
    entries = {name: memo.stamped(entry) for name, entry in entries.items()}  # as verified: mapped by that stamp
    return Adopted(entries, manifest, resumed=len(extra), failed={**failed, **bad}, memo=memo, damaged=damaged,
                   vouched=vouched and not extra and not bad)


def _vouched(manifest: Manifest | None, memo: VerifiedMemo) -> bool:
    """The manifest is sealed complete and the memo vouches for every layer it lists
    (a memo that is not trusted, after recorded damage, vouches for none)."""
    return bool(manifest and manifest.complete and manifest.layers
                and all(memo.holds(e) for e in manifest.layers.values()))
