"""What the executor measured, per pass, next to what the plan predicted.

Bytes read from disk come from ``/proc/self/io`` (``read_bytes``: what this process,
all its threads, made the block layer fetch), so a read the page cache served costs
nothing and the figure is the disk's, not the reader's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from hostmem.procfs.io import read_io_bytes  # the executor's face names it too

__all__ = ["PassStats", "ExecutorStats", "read_io_bytes"]


@dataclass
class PassStats:
    """One forward pass of one component under the executor."""

    component: str
    index: int
    seconds: float = 0.0
    read_bytes: int = 0  # from disk, /proc/self/io
    read_ahead_bytes: int = 0  # asked of the reader (page cache hits included)
    released_bytes: int = 0
    copied_bytes: int = 0  # host to device (CUDA only)
    wait_s: float = 0.0  # the compute waited on reads and copies
    late_layers: int = 0  # layers read or copied at their own forward: no read-ahead of what they hold now
    failed_read_aheads: int = 0  # read-aheads that raised (the layer was then read at its forward)
    failed_releases: int = 0  # releases that failed on the worker thread (their bytes not in released_bytes)
    predicted_read_bytes: int = 0  # warm pass, as planned: the released layers
    predicted_s: float | None = None  # predicted_read_bytes at the configured disk rate


@dataclass
class ExecutorStats:
    """Everything an executor measured; ``to_dict()`` is JSON (sizes in bytes)."""

    reader: str
    device: str
    roles: dict = field(default_factory=dict)  # component -> {role: layer count}
    kept_bytes: dict = field(default_factory=dict)
    predicted_read_bytes: dict = field(default_factory=dict)
    pinned_bytes: int = 0
    passes: list[PassStats] = field(default_factory=list)

    def warm(self, component: str) -> list[PassStats]:
        """Passes after the first of ``component`` (the first also reads what is kept)."""
        return [p for p in self.passes if p.component == component][1:]

    def to_dict(self) -> dict:
        return {
            "reader": self.reader,
            "device": self.device,
            "roles": self.roles,
            "kept_bytes": self.kept_bytes,
            "predicted_read_bytes": self.predicted_read_bytes,
            "pinned_bytes": self.pinned_bytes,
            "passes": [asdict(p) for p in self.passes],
        }
