"""What checkpoint remap could give back, as an offer the planner weighs like the LoRA cache's.

The offer is sized from headers and residency only, without comparing a byte: the
anonymous bytes of every tensor whose checkpoint holds a tensor of the same name,
shape and dtype. That is an upper bound (a tensor changed after load is found out
only by :func:`hostmem.remap` itself), and the note says so. Remap needs no disk; its
one-time cost is reading the checkpoint once to compare, at page-cache speed.

Tensors the checkpoint holds in another dtype (cast at load), and parameters it does
not hold at all (fused or computed at load), cannot be remapped, only spilled (``hostmem.remap(spill=True)``: written once to the cache and mapped back). A
provider made with ``spill=True`` offers them too, with the disk their layer files take
and the time to hash and write them, as the LoRA cache offers its merged layers;
without it, the note says how much a spill would add.

The offer is a :class:`hostmem.providers.OfferRecord`, the protocol every provider
meets; nothing here imports ``planners``.
"""

from __future__ import annotations

from typing import NamedTuple

from ..errors import InputError
from .checkpoint import CheckpointIndex, spillable, component_files
from ..providers import OfferRecord
from ..residency import RangeClassifier
from ..slots import MappedAreas, iter_module_slots
from ..units import format_rate, format_size

__all__ = ["RemapOffer", "RemapProvider", "RemapSizes", "remap_sizes", "remappable_anonymous_bytes",
           "DEFAULT_COMPARE_RATE", "DEFAULT_SPILL_RATE"]

# Reading a checkpoint from page cache and comparing it with the heap copy; the
# benchmark (bench/bench_diffusers.py) measures the real figure on a machine.
DEFAULT_COMPARE_RATE = 1024 * 1024 * 1024
# Hashing the cast weights and writing them to the cache the first time (the disk bounds it).
DEFAULT_SPILL_RATE = 512 * 1024 * 1024


class RemapOffer(OfferRecord):
    """Anonymous bytes remap can turn into mapped ones, and what that costs."""

    __slots__ = ()


class RemapSizes(NamedTuple):
    """Anonymous bytes remap could replace, and those only a spill could (with their disk)."""

    remappable: int
    castable: int  # anonymous, only a spill gives back: cast at load, or a parameter fused or computed at load
    castable_disk: int  # the layer files a spill of them writes


def _anonymous(ranges: list[tuple[int, int]]) -> int:
    if not ranges:
        return 0
    with RangeClassifier() as classifier:
        return sum(r.anonymous for r in classifier.classify_many(ranges))


def remap_sizes(module, files=None) -> RemapSizes:
    """Size remap and its spill for ``module`` from its checkpoint's headers and residency."""
    from ..vault.layer_file import layer_file_bytes

    shards = component_files(module, files).shards[""]
    index, areas = CheckpointIndex(shards), MappedAreas()
    same, cast, disk = [], [], 0
    for _, slot in iter_module_slots(module):
        tensor = slot.tensor
        if tensor.device.type != "cpu" or slot.nbytes == 0 or areas.read_only_page_cache(tensor) is not None:
            continue
        candidates = index.candidates(slot.name, tuple(tensor.shape))
        if not candidates and not spillable("missing", slot):
            continue
        start = tensor.untyped_storage().data_ptr()
        if any(c.dtype == tensor.dtype for c in candidates):
            same.append((start, start + tensor.untyped_storage().nbytes()))
        else:
            cast.append((start, start + tensor.untyped_storage().nbytes()))
            disk += layer_file_bytes(tuple(tensor.shape), tensor.dtype)
    castable = _anonymous(cast)
    return RemapSizes(_anonymous(same), castable, disk if castable else 0)


def remappable_anonymous_bytes(module, files=None) -> int:
    """Anonymous bytes of ``module``'s tensors that a checkpoint tensor (name, shape, dtype) could replace."""
    return remap_sizes(module, files).remappable


class RemapProvider:
    """Offers the checkpoint remap of one loaded component to the planner (with its spill
    when ``spill``: then the cast bytes too, for the disk their layer files take)."""

    name = "remap"

    def __init__(self, component: str, anonymous_bytes: int, *, compare_rate: float = DEFAULT_COMPARE_RATE,
                 spill: bool = False, spill_bytes: int = 0, spill_disk_bytes: int = 0,
                 spill_rate: float = DEFAULT_SPILL_RATE):
        sizes = (("remappable", anonymous_bytes), ("spillable", spill_bytes), ("spill disk", spill_disk_bytes))
        for what, value in sizes:
            if value < 0:
                raise InputError(f"{what} bytes of {component!r} must not be negative, got {value}")
        self.component = component
        self.anonymous_bytes = int(anonymous_bytes)
        self.compare_rate = compare_rate
        self.spill, self.spill_bytes, self.spill_disk_bytes = spill, int(spill_bytes), int(spill_disk_bytes)
        self.spill_rate = spill_rate

    @classmethod
    def from_model(cls, component: str, module, files=None, *, spill: bool = False, **kwargs) -> "RemapProvider":
        """Size the offer from ``module`` and its checkpoint (found from its config unless ``files``)."""
        sizes = remap_sizes(module, files)
        return cls(component, sizes.remappable, spill=spill, spill_bytes=sizes.castable,
                   spill_disk_bytes=sizes.castable_disk, **kwargs)

    def offer(self) -> RemapOffer | None:
        """The offer, or None when nothing anonymous equals a checkpoint tensor (nor would be spilled)."""
        spilled = self.spill_bytes if self.spill else 0
        if self.anonymous_bytes + spilled == 0:
            return None
        compare = self.anonymous_bytes / self.compare_rate
        note = (
            f"checkpoint remap of {self.component}: up to {format_size(self.anonymous_bytes)} of anonymous weights "
            f"still match the checkpoint by name, shape and dtype and can be mapped back read-only "
            f"(hostmem.remap; no disk, about {compare:.0f} s at {format_rate(self.compare_rate)} to compare)"
        )
        write = self.spill_disk_bytes / self.spill_rate if spilled else 0.0
        disk = self.spill_disk_bytes if spilled else 0
        return RemapOffer(self.name, self.component, self.anonymous_bytes + spilled, disk, compare + write,
                          note + self._spill_note())

    def _spill_note(self) -> str:
        if not self.spill_bytes:
            return ""
        what = (f"{format_size(self.spill_bytes)} more are cast, fused or computed at load (no checkpoint tensor "
                f"holds their bytes): "
                f"a spill writes them once to the cache ({format_size(self.spill_disk_bytes)} of disk)")
        if self.spill:
            seconds = self.spill_disk_bytes / self.spill_rate
            return (f"; {what} and maps them back read-only (hostmem.remap(spill=True); about {seconds:.0f} s "
                    f"at {format_rate(self.spill_rate)} the first time, nothing once cached)")
        return f"; {what}: hostmem.remap(spill=True) would map them back too"

    def __repr__(self) -> str:
        return f"RemapProvider({self.component!r}, {format_size(self.anonymous_bytes)})"
