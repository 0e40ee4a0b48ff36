"""The residency classes and :class:`Residency`, the bytes of a range per class.

Kept apart from the classifier so that planners can do arithmetic on residency
without importing torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

__all__ = ["CLASSES", "Residency"]

CLASSES = ("anonymous", "file_backed", "shmem", "pinned", "swapped", "not_resident")


@dataclass(frozen=True)
class Residency:
    """Bytes of one range (or a sum of ranges) per residency class."""

    anonymous: int = 0
    file_backed: int = 0
    shmem: int = 0
    pinned: int = 0
    swapped: int = 0
    not_resident: int = 0
    # Of ``pinned``, the bytes of anonymous memory (mlocked heap, registered host
    # buffers): the kernel still counts them in RssAnon. Not a class of its own.
    pinned_anonymous: int = 0

    def __add__(self, other: "Residency") -> "Residency":
        return Residency(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    @property
    def non_reclaimable(self) -> int:
        """Anonymous + shmem + pinned: what the kernel cannot drop without swap."""
        return self.anonymous + self.shmem + self.pinned

    @property
    def resident(self) -> int:
        return self.anonymous + self.file_backed + self.shmem + self.pinned

    @property
    def total(self) -> int:
        return self.resident + self.swapped + self.not_resident

    def to_dict(self) -> dict[str, int]:
        """JSON-safe dict in bytes, with ``non_reclaimable`` added."""
        out = asdict(self)
        out["non_reclaimable"] = self.non_reclaimable
        return out
