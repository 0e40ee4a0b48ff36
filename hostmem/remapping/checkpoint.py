"""Checkpoint remap: weights that still equal their checkpoint become views of it again.

A loader that copies (``from_pretrained(disable_mmap=True)``, a cast at load, a
state dict read into the heap) leaves every weight in anonymous memory, which a host
without swap can never get back, although most of those bytes are still exactly the
checkpoint's. :func:`remap` compares each parameter and buffer with the checkpoint
tensor of the same name, shape and dtype, byte for byte, and where they are equal
points the model at a read-only mapping of that tensor (``MAP_SHARED``/``PROT_READ``:
page cache the kernel can drop, and a stray write faults instead of copying the page);
the anonymous copy is then freed. A buffer is state a model may write (BatchNorm's
running statistics in training, a step counter): one equal to its checkpoint tensor
becomes a view of the file mapped private and writable instead, as safetensors maps
it, page cache until a write copies a page (a read-only view would fault on the write).
Views of a read-only mapping of a file on tmpfs or /dev/shm are not "already mapped":
their pages are shmem, never given back, so they are compared and remapped too. What
differs stays as it is and is reported by
reason: ``cast`` (the checkpoint holds it in another dtype: diffusers keeps
``_keep_in_fp32_modules`` in fp32 over a bf16 checkpoint, for one), ``changed`` (same
dtype and shape, other bytes: a fused or merged weight), ``missing`` (no checkpoint
tensor of that name and shape: a non-persistent buffer), ``device`` (not in host
memory) and ``layout`` (a non-contiguous view or a tensor subclass, which a plain view
of the file cannot stand in for).

``cast`` and ``changed`` weights, and ``missing`` parameters (fused at or after load,
as by diffusers' ``fuse_qkv_projections()``, or computed), have no bytes on disk to
point at. With ``spill=True`` they are written once to the cache instead and mapped
back read-only (:mod:`hostmem.remapping.spill`), so they too become page cache; the report
counts them as spilled, with the bytes written and found already cached, and says
what each was (``spill_origins``: cast, changed, fused from which checkpoint tensors,
computed; :mod:`hostmem.remapping.origin`). Missing buffers stay: a model may write them.

After a remap the weights are views of a mapped file, so ``lora_cache.merge`` finds the
checkpoint by itself (no ``base_files``) and keeps no anonymous original for unmerge.
The comparison is exact (bytes, not values: ``-0.0`` differs from ``0.0``), so a
remapped model computes bit for bit what the same model computes when diffusers maps
the checkpoint itself (its default load): the weights sit at the same file offsets.
Against the heap copy it replaces, the last bit of an output may differ, because
CPU matmul kernels round by the weights' alignment (the heap aligns to 64 bytes, a
file offset often less); a heap copy placed at the file's offsets matches bit for bit.
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .files import CheckpointNotFound, checkpoint_files, expand_files
from ..pagemap import PagemapReader
from ..safetensors.header import read_header
from ..safetensors.mapping import CopyOnWriteSafetensors, open_readonly
from .same_bytes import same_bytes
from ..slots import MappedAreas, TensorSlot, iter_module_slots, model_components
from ..torch_threads import one_thread
from ..units import format_size

__all__ = ["RemapReport", "remap", "REASONS", "CheckpointIndex", "ComponentShards", "component_files"]

REASONS = ("cast", "changed", "missing", "device", "layout")
_SAMPLE_NAMES = 5  # names kept per reason, for the report

@dataclass
class RemapReport:
    """What :func:`remap` did. Sizes are bytes."""

    remapped_bytes: int = 0
    remapped: int = 0
    already_mapped_bytes: int = 0
    spilled_bytes: int = 0  # cast or changed weights now mapped from the spill cache
    spilled: int = 0
    spill_written_bytes: int = 0  # layer-file bytes this call wrote (0 when the cache had them all)
    spill_reused_bytes: int = 0  # layer-file bytes found in the cache, verified
    spill_key: str = ""
    spill_root: str = ""
    spill_problem: str | None = None  # why some weights could not be spilled
    spill_origins: dict[str, str] = field(default_factory=dict)  # spilled weight -> what it was (remap_origin)
    left_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    left_names: dict[str, list[str]] = field(default_factory=lambda: {r: [] for r in REASONS})
    files: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # component -> why its checkpoint was not found
    seconds: float = 0.0

    def leave(self, reason: str, name: str, nbytes: int) -> None:
        self.left_bytes[reason] += nbytes
        if len(self.left_names[reason]) < _SAMPLE_NAMES:
            self.left_names[reason].append(name)

    @property
    def total_left_bytes(self) -> int:
        return sum(self.left_bytes.values())

    def to_dict(self) -> dict:
        return {
            "remapped_bytes": self.remapped_bytes,
            "remapped": self.remapped,
            "already_mapped_bytes": self.already_mapped_bytes,
            "spilled_bytes": self.spilled_bytes,
            "spilled": self.spilled,
            "spill_written_bytes": self.spill_written_bytes,
            "spill_reused_bytes": self.spill_reused_bytes,
            "spill_key": self.spill_key,
            "spill_root": self.spill_root,
            "spill_problem": self.spill_problem,
            "spill_origins": dict(self.spill_origins),
            "left_bytes": dict(self.left_bytes),
            "left_names": {k: list(v) for k, v in self.left_names.items()},
            "files": list(self.files),
            "skipped": dict(self.skipped),
            "seconds": self.seconds,
        }

    def __str__(self) -> str:
        left = ", ".join(f"{format_size(b)} {r} ({', '.join(self.left_names[r][:2])}{', ...' if b and len(self.left_names[r]) > 2 else ''})"
                         for r, b in self.left_bytes.items() if b)
        return (
            f"remap: {format_size(self.remapped_bytes)} remapped ({self.remapped} tensors) from "
            f"{len(self.files)} file(s), {format_size(self.already_mapped_bytes)} already mapped read-only; "
            f"{self._spill_text()}"
            f"left {format_size(self.total_left_bytes)}{': ' + left if left else ''}; {self.seconds:.2f} s"
            + "".join(f"; component {name!r} skipped ({why})" for name, why in self.skipped.items())
        )


    def _spill_text(self) -> str:
        if not (self.spilled or self.spill_problem):
            return ""
        kinds: dict[str, int] = {}
        for origin in self.spill_origins.values():
            kind = origin.split(" ", 1)[0]
            kinds[kind] = kinds.get(kind, 0) + 1
        what = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
        text = (f"{format_size(self.spilled_bytes)} spilled ({self.spilled} tensors{': ' + what if what else ''}; "
                f"{format_size(self.spill_written_bytes)} written, {format_size(self.spill_reused_bytes)} "
                f"reused from the cache in {self.spill_root})")
        return text + (f", not all: {self.spill_problem}" if self.spill_problem else "") + "; "


@dataclass(frozen=True)
class _Source:
    """One checkpoint tensor: the file it is in and its name there."""

    path: str
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def _dotted_suffixes(name: str) -> list[str]:
    """``a.b.c`` -> ``["a.b.c", "b.c", "c"]``."""
    parts = name.split(".")
    return [".".join(parts[i:]) for i in range(len(parts))]


class CheckpointIndex:
    """The checkpoint's tensors by name, and by every dotted suffix of their names.

    Names match exactly first; then up to wrapper prefixes on either side (a model
    holding ``model.blocks.0.w`` against a file's ``blocks.0.w``, or the reverse), which
    is safe because a candidate is only used when its bytes are equal.
    """

    def __init__(self, files: list[str]):
        self.exact: dict[str, list[_Source]] = {}
        self.ending: dict[str, list[_Source]] = {}
        self._mapped: dict[tuple[str, bool], object] = {}  # (path, private) -> its mapping, made on first use
        self._by_parent: dict[tuple[str, str], list[_Source]] | None = None  # built on first siblings()
        for path in files:
            for name, info in read_header(path).tensors.items():
                source = _Source(path, name, tuple(info.shape), info.torch_dtype)
                self.exact.setdefault(name, []).append(source)
                for suffix in _dotted_suffixes(name)[1:]:
                    self.ending.setdefault(suffix, []).append(source)

    def view(self, source: _Source, copy_on_write: bool = False) -> torch.Tensor:
        """A read-only view of ``source`` (its file is mapped once, on first use), or with
        ``copy_on_write`` one of the file mapped private and writable (for a buffer)."""
        at = (source.path, copy_on_write)
        if at not in self._mapped:
            self._mapped[at] = CopyOnWriteSafetensors(source.path) if copy_on_write else open_readonly(source.path)
        return self._mapped[at].get_tensor(source.name)

    def candidates(self, name: str, shape: tuple[int, ...]) -> list[_Source]:
        found = list(self.exact.get(name, []))
        for suffix in _dotted_suffixes(name)[1:]:
            found += self.exact.get(suffix, [])
        found += self.ending.get(name, [])
        return _unique(s for s in found if s.shape == shape)

    def siblings(self, name: str, row_shape: tuple[int, ...], dtype: torch.dtype) -> list[_Source]:
        """Tensors of the module that holds ``name`` (same parent, same leaf such as
        ``weight``) whose rows have ``row_shape`` and ``dtype``: what a fused weight's rows
        may be made of (:mod:`hostmem.remapping.origin`)."""
        if self._by_parent is None:
            self._by_parent = {}
            for source in (s for sources in self.exact.values() for s in sources):
                parts = source.name.split(".")
                for parent in _dotted_suffixes(".".join(parts[:-2])) if len(parts) > 2 else [""]:
                    self._by_parent.setdefault((parent, parts[-1]), []).append(source)
        parts = name.split(".")
        parents = _dotted_suffixes(".".join(parts[:-2])) if len(parts) > 2 else [""]
        for parent in parents:  # the longest parent that names any: a shorter one spans other modules
            found = _unique(s for s in self._by_parent.get((parent, parts[-1]), [])
                            if s.shape and s.shape[1:] == row_shape and s.dtype == dtype)
            if found:
                return found
        return []


def _unique(sources) -> list[_Source]:
    seen, out = set(), []
    for source in sources:
        if id(source) not in seen:
            seen.add(id(source))
            out.append(source)
    return out


def _is_plain(tensor: torch.Tensor) -> bool:
    return type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.is_contiguous()


def _remap_slot(slot: TensorSlot, index: CheckpointIndex, areas: MappedAreas, report: RemapReport) -> str | None:
    """Point one tensor at its checkpoint bytes; return why it stays (a reason), or None."""
    tensor = slot.tensor
    if tensor.device.type != "cpu":
        return "device"
    if slot.nbytes == 0:
        return None
    state = any(kind == "_buffers" for _, kind, _ in slot.places)  # a model may write it: never read-only
    if areas.read_only_page_cache(tensor) is not None or (state and _unwritten_copy_on_write(areas, tensor)):
        report.already_mapped_bytes += slot.nbytes
        return None
    if not _is_plain(tensor):
        return "layout"
    candidates = index.candidates(slot.name, tuple(tensor.shape))
    same_dtype = [c for c in candidates if c.dtype == tensor.dtype]
    if not candidates:
        return "missing"
    if not same_dtype:
        return "cast"
    detached = tensor.detach()
    for source in same_dtype:
        view = index.view(source, copy_on_write=state)
        if same_bytes(detached, view):
            slot.replace(view)
            report.remapped += 1
            report.remapped_bytes += slot.nbytes
            return None
    return "changed"


def _unwritten_copy_on_write(areas: MappedAreas, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view of a private file mapping (a buffer remapped before)
    none of whose pages under it a write has copied."""
    if areas.copy_on_write_page_cache(tensor) is None:
        return False
    start = tensor.untyped_storage().data_ptr()
    try:
        with PagemapReader() as pagemap:
            return pagemap.private_copies(start, start + tensor.untyped_storage().nbytes()) == 0
    except OSError:  # pagemap unreadable: compare it again, as any other tensor
        return False


def _return_freed_memory() -> None:
    """Ask glibc to hand freed heap blocks back to the kernel (no-op elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class ComponentShards(NamedTuple):
    """Each component's shards, and the components left out with why (no checkpoint found)."""

    shards: dict[str, list[str]]
    skipped: dict[str, str]


def component_files(model, files) -> ComponentShards:
    """The shards per component: ``files`` for all, a ``{component: files}`` dict (the
    others found from their own config), or each component's own. A component whose
    checkpoint cannot be found is left out, with why, while another one's is found (a
    pipeline with a module built in memory); when none is, the first reason is raised."""
    components = model_components(model)
    if files is not None and not isinstance(files, Mapping):
        shards = expand_files(files)
        return ComponentShards({name: shards for name in components}, {})
    given = dict(files or {})
    unknown = sorted(set(given) - set(components))
    if unknown:
        raise CheckpointNotFound(f"files= names {', '.join(map(repr, unknown))}, which the model has no component "
                                 f"of: its components are {', '.join(map(repr, components)) or 'none'}")
    found, skipped, first = {}, {}, None
    for name, module in components.items():
        try:
            found[name] = expand_files(given[name]) if name in given else checkpoint_files(module, name)
        except CheckpointNotFound as exc:
            first = first or exc
            skipped[name] = str(exc)
    if first is not None and not found:
        raise first
    return ComponentShards(found, skipped)


@torch.no_grad()
def remap(model, files=None, *, spill: bool = False, cache_root=None, max_size=None) -> RemapReport:
    """Point every weight of ``model`` that equals its checkpoint tensor at a read-only mapping of it.

    ``model`` is a module, a dict of named modules or a pipeline (its module
    components); ``files`` is a shard, a folder or a list of them, for every component,
    or a dict of them by component (default: each component's own checkpoint, found from
    its config; see :func:`hostmem.remapping.files.checkpoint_files`). A component whose
    checkpoint cannot be found is left as it is, named in ``skipped`` with why, while the
    others are remapped (none found: :class:`~hostmem.remapping.files.CheckpointNotFound`).
    Returns a :class:`RemapReport`: bytes remapped, spilled, and left per reason (with a
    few names each), the components skipped, files and time.

    With ``spill=True`` the weights left as ``cast`` or ``changed`` and the parameters no
    checkpoint tensor holds (fused, computed) are written once to
    the cache (one verified layer file each, keyed by the checkpoint's content and their
    own bytes: see :mod:`hostmem.remapping.spill`) and mapped back read-only; a later start
    with the same bytes finds them and writes nothing. ``cache_root`` is one root or an
    ordered list, as for ``lora_cache.merge`` (default ``$HOSTMEM_CACHE_ROOT``, else
    ``~/.cache/hostmem``); ``max_size`` caps the cache as there.

    >>> report = hostmem.remap(pipe.transformer, spill=True)   # doctest: +SKIP
    >>> print(report)                                          # doctest: +SKIP
    """
    start = time.monotonic()
    report = RemapReport()
    pending = _remap_all(model, files, report, spill)
    if pending:
        from .spill import spill as spill_pending

        for item in spill_pending(pending, report, cache_root, max_size):
            report.leave(item.reason, item.label, item.slot.nbytes)
    _return_freed_memory()
    if report.remapped or report.spilled:
        from ..safetensors.writers import guard_foreign_writers

        guard_foreign_writers()
    report.seconds = time.monotonic() - start
    return report


def spillable(reason: str | None, slot: TensorSlot) -> bool:
    """Whether a spill takes a weight remap left: a cast or changed one, and a parameter no
    checkpoint tensor holds (fused or computed at load). A missing buffer stays: buffers
    are state a model may write (a cache, running statistics), never a weight to map."""
    from .spill import SPILLED_REASONS

    if reason == "missing":
        return all(kind == "_parameters" for _, kind, _ in slot.places)
    return reason in SPILLED_REASONS


def _remap_all(model, files, report: RemapReport, spill: bool) -> list:
    """Remap every tensor of every component; return those a spill is to take (with ``spill``)."""
    from .origin import origin_of
    from .spill import Pending

    shards_of, skipped = component_files(model, files)
    report.skipped = dict(skipped)
    indexes: dict[tuple[str, ...], CheckpointIndex] = {}
    areas = MappedAreas()
    pending = []
    with one_thread():  # memory-bound: one thread, and no barrier stalls on a busy host
        for component, slot in iter_module_slots(model):
            if component in skipped:
                continue
            shards = tuple(shards_of[component])
            if shards not in indexes:
                indexes[shards] = CheckpointIndex(list(shards))
                report.files += [s for s in shards if s not in report.files]
            label = f"{component}.{slot.name}" if component else slot.name
            reason = _remap_slot(slot, indexes[shards], areas, report)
            if spill and spillable(reason, slot):
                origin = origin_of(reason, slot.name, slot.tensor, indexes[shards])
                pending.append(Pending(label, slot, reason, shards, origin))
            elif reason is not None:
                report.leave(reason, label, slot.nbytes)
    return pending
