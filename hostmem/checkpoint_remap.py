"""Checkpoint remap: weights that still equal their checkpoint become views of it again.

A loader that copies (``from_pretrained(disable_mmap=True)``, a cast at load, a
state dict read into the heap) leaves every weight in anonymous memory, which a host
without swap can never get back, although most of those bytes are still exactly the
checkpoint's. :func:`remap` compares each parameter and buffer with the checkpoint
tensor of the same name, shape and dtype, byte for byte, and where they are equal
points the model at a read-only mapping of that tensor (``MAP_SHARED``/``PROT_READ``:
page cache the kernel can drop, and a stray write faults instead of copying the page);
the anonymous copy is then freed. What differs stays as it is and is reported by
reason: ``cast`` (the checkpoint holds it in another dtype: diffusers keeps
``_keep_in_fp32_modules`` in fp32 over a bf16 checkpoint, for one), ``changed`` (same
dtype and shape, other bytes: a fused or merged weight), ``missing`` (no checkpoint
tensor of that name and shape: a non-persistent buffer), ``device`` (not in host
memory) and ``layout`` (a non-contiguous view or a tensor subclass, which a plain view
of the file cannot stand in for).

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
from dataclasses import dataclass, field

import torch

from .checkpoint_files import checkpoint_files, expand_files
from .safetensors_header import read_header
from .safetensors_map import open_readonly
from .slots import MappedAreas, TensorSlot, iter_module_slots, model_components
from .units import format_size

__all__ = ["RemapReport", "remap", "REASONS", "CheckpointIndex", "component_files"]

REASONS = ("cast", "changed", "missing", "device", "layout")
_SAMPLE_NAMES = 5  # names kept per reason, for the report

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class RemapReport:
    """What :func:`remap` did. Sizes are bytes."""

    remapped_bytes: int = 0
    remapped: int = 0
    already_mapped_bytes: int = 0
    left_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    left_names: dict[str, list[str]] = field(default_factory=lambda: {r: [] for r in REASONS})
    files: list[str] = field(default_factory=list)
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
            "left_bytes": dict(self.left_bytes),
            "left_names": {k: list(v) for k, v in self.left_names.items()},
            "files": list(self.files),
            "seconds": self.seconds,
        }

    def __str__(self) -> str:
        left = ", ".join(f"{format_size(b)} {r} ({', '.join(self.left_names[r][:2])}{', ...' if b and len(self.left_names[r]) > 2 else ''})"
                         for r, b in self.left_bytes.items() if b)
        return (
            f"remap: {format_size(self.remapped_bytes)} remapped ({self.remapped} tensors) from "
            f"{len(self.files)} file(s), {format_size(self.already_mapped_bytes)} already mapped read-only; "
            f"left {format_size(self.total_left_bytes)}{': ' + left if left else ''}; {self.seconds:.2f} s"
        )


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
        self._mapped: dict[str, object] = {}  # path -> ReadOnlySafetensors, mapped on first use
        for path in files:
            for name, info in read_header(path).tensors.items():
                source = _Source(path, name, tuple(info.shape), info.torch_dtype)
                self.exact.setdefault(name, []).append(source)
                for suffix in _dotted_suffixes(name)[1:]:
                    self.ending.setdefault(suffix, []).append(source)

    def view(self, source: _Source) -> torch.Tensor:
        """A read-only view of ``source`` (its file is mapped once, on first use)."""
        if source.path not in self._mapped:
            self._mapped[source.path] = open_readonly(source.path)
        return self._mapped[source.path].get_tensor(source.name)

    def candidates(self, name: str, shape: tuple[int, ...]) -> list[_Source]:
        found = list(self.exact.get(name, []))
        for suffix in _dotted_suffixes(name)[1:]:
            found += self.exact.get(suffix, [])
        found += self.ending.get(name, [])
        seen, out = set(), []
        for source in found:
            if source.shape == shape and id(source) not in seen:
                seen.add(id(source))
                out.append(source)
        return out


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact byte equality of two contiguous tensors, in one pass over the widest integers
    that tile both (int64 where their addresses and sizes allow: 3x faster than int16)."""
    a, b = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    if a.numel() != b.numel():
        return False
    width = next(w for w in (8, 4, 2, 1) if a.numel() % w == 0 and a.data_ptr() % w == 0 and b.data_ptr() % w == 0)
    return torch.equal(a.view(_INT_OF_SIZE[width]), b.view(_INT_OF_SIZE[width]))


@contextlib.contextmanager
def _one_thread():
    """Compare on one thread: a memory-bound pass gains nothing from more, and torch's
    thread pool stalls at every operation's barrier when the cores are busy (measured
    with load 7 on 2 cores: 2 MiB compared in 30 ms on 2 threads, 1.4 ms on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _is_plain(tensor: torch.Tensor) -> bool:
    return type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.is_contiguous()


def _remap_slot(slot: TensorSlot, index: CheckpointIndex, areas: MappedAreas, report: RemapReport, label: str):
    """Point one tensor at its checkpoint bytes, or record why it stays."""
    tensor = slot.tensor
    if tensor.device.type != "cpu":
        return report.leave("device", label, slot.nbytes)
    if slot.nbytes == 0:
        return None
    if areas.read_only_file(tensor) is not None:
        report.already_mapped_bytes += slot.nbytes
        return None
    if not _is_plain(tensor):
        return report.leave("layout", label, slot.nbytes)
    candidates = index.candidates(slot.name, tuple(tensor.shape))
    same_dtype = [c for c in candidates if c.dtype == tensor.dtype]
    if not candidates:
        return report.leave("missing", label, slot.nbytes)
    if not same_dtype:
        return report.leave("cast", label, slot.nbytes)
    detached = tensor.detach()
    for source in same_dtype:
        view = index.view(source)
        if _same_bytes(detached, view):
            slot.replace(view)
            report.remapped += 1
            report.remapped_bytes += slot.nbytes
            return None
    return report.leave("changed", label, slot.nbytes)


def _return_freed_memory() -> None:
    """Ask glibc to hand freed heap blocks back to the kernel (no-op elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def component_files(model, files) -> dict[str, list[str]]:
    """The shards per component: ``files`` for all, or each component's own."""
    components = model_components(model)
    if files is not None:
        shards = expand_files(files)
        return {name: shards for name in components}
    return {name: checkpoint_files(module, name) for name, module in components.items()}


@torch.no_grad()
def remap(model, files=None) -> RemapReport:
    """Point every weight of ``model`` that equals its checkpoint tensor at a read-only mapping of it.

    ``model`` is a module, a dict of named modules or a pipeline (its module
    components); ``files`` is a shard, a folder or a list of them, for every component
    (default: each component's own checkpoint, found from its config; see
    :func:`hostmem.checkpoint_files.checkpoint_files`). Returns a :class:`RemapReport`:
    bytes remapped, bytes left per reason (with a few names each), files and time.

    >>> report = hostmem.remap(pipe.transformer)   # doctest: +SKIP
    >>> print(report)                              # doctest: +SKIP
    """
    start = time.monotonic()
    report = RemapReport()
    shards_of = component_files(model, files)
    indexes: dict[tuple[str, ...], CheckpointIndex] = {}
    areas = MappedAreas()
    with _one_thread():
        for component, slot in iter_module_slots(model):
            shards = tuple(shards_of[component])
            if shards not in indexes:
                indexes[shards] = CheckpointIndex(list(shards))
                report.files += [s for s in shards if s not in report.files]
            label = f"{component}.{slot.name}" if component else slot.name
            _remap_slot(slot, indexes[shards], areas, report, label)
    _return_freed_memory()
    if report.remapped:
        from .writers import guard_foreign_writers

        guard_foreign_writers()
    report.seconds = time.monotonic() - start
    return report
