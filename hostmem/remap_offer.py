"""What checkpoint remap could give back, as an offer the planner weighs like the LoRA cache's.

The offer is sized from headers and residency only, without comparing a byte: the
anonymous bytes of every tensor whose checkpoint holds a tensor of the same name,
shape and dtype. That is an upper bound (a tensor changed after load is found out
only by :func:`hostmem.remap` itself), and the note says so. Remap needs no disk; its
one-time cost is reading the checkpoint once to compare, at page-cache speed.

The planner's interface is met by attribute names (``provider``, ``component``,
``anonymous_bytes``, ``disk_bytes``, ``one_time_s``, ``note``): imports point down,
so nothing here imports ``planners``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .checkpoint_remap import CheckpointIndex, component_files
from .residency import RangeClassifier
from .slots import MappedAreas, iter_module_slots
from .units import format_rate, format_size

__all__ = ["RemapOffer", "RemapProvider", "remappable_anonymous_bytes", "DEFAULT_COMPARE_RATE"]

# Reading a checkpoint from page cache and comparing it with the heap copy; the
# benchmark (bench/bench_diffusers.py) measures the real figure on a machine.
DEFAULT_COMPARE_RATE = 1024 * 1024 * 1024


@dataclass(frozen=True)
class RemapOffer:
    """Anonymous bytes remap can turn into mapped ones, and what that costs."""

    provider: str
    component: str
    anonymous_bytes: int
    disk_bytes: int
    one_time_s: float
    note: str


def remappable_anonymous_bytes(module, files=None) -> int:
    """Anonymous bytes of ``module``'s tensors that a checkpoint tensor (name, shape, dtype) could replace."""
    shards = component_files(module, files)[""]
    index, areas = CheckpointIndex(shards), MappedAreas()
    ranges = []
    for _, slot in iter_module_slots(module):
        tensor = slot.tensor
        if tensor.device.type != "cpu" or slot.nbytes == 0 or areas.read_only_file(tensor) is not None:
            continue
        if any(c.dtype == tensor.dtype for c in index.candidates(slot.name, tuple(tensor.shape))):
            start = tensor.untyped_storage().data_ptr()
            ranges.append((start, start + tensor.untyped_storage().nbytes()))
    if not ranges:
        return 0
    with RangeClassifier() as classifier:
        return sum(r.anonymous for r in classifier.classify_many(ranges))


class RemapProvider:
    """Offers the checkpoint remap of one loaded component to the planner."""

    name = "remap"

    def __init__(self, component: str, anonymous_bytes: int, *, compare_rate: float = DEFAULT_COMPARE_RATE):
        if anonymous_bytes < 0:
            raise ValueError(f"remappable bytes of {component!r} must not be negative, got {anonymous_bytes}")
        self.component = component
        self.anonymous_bytes = int(anonymous_bytes)
        self.compare_rate = compare_rate

    @classmethod
    def from_model(cls, component: str, module, files=None, **kwargs) -> "RemapProvider":
        """Size the offer from ``module`` and its checkpoint (found from its config unless ``files``)."""
        return cls(component, remappable_anonymous_bytes(module, files), **kwargs)

    def offer(self) -> RemapOffer | None:
        """The offer, or None when nothing anonymous equals a checkpoint tensor."""
        if self.anonymous_bytes == 0:
            return None
        seconds = self.anonymous_bytes / self.compare_rate
        note = (
            f"checkpoint remap of {self.component}: up to {format_size(self.anonymous_bytes)} of anonymous weights "
            f"still match the checkpoint by name, shape and dtype and can be mapped back read-only "
            f"(hostmem.remap; no disk, about {seconds:.0f} s at {format_rate(self.compare_rate)} to compare)"
        )
        return RemapOffer(self.name, self.component, self.anonymous_bytes, 0, seconds, note)

    def __repr__(self) -> str:
        return f"RemapProvider({self.component!r}, {format_size(self.anonymous_bytes)})"
