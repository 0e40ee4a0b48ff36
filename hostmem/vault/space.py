"""Room for a build: what it needs against what the disk and ``max_size`` allow."""

from __future__ import annotations

from dataclasses import dataclass

from hostmem.units import format_size

__all__ = ["SpaceCheck"]


@dataclass(frozen=True)
class SpaceCheck:
    """Room for a build: what it needs against what the disk and ``max_size`` allow.

    ``available`` is the smaller of (free disk - headroom) and (max_size - bytes the
    cache already holds); ``needed`` is what the layers still to write take.
    """

    needed: int
    available: int
    free_disk: int
    headroom: int
    max_size: int | None
    folder: str
    read_only: bool = False  # a read-only root: nothing can be written there at all
    label: str = "LoRA merge cache"  # the store's name in messages (the vault's ``label``)

    @property
    def ok(self) -> bool:
        return self.needed <= self.available and not (self.read_only and self.needed)

    @property
    def message(self) -> str:
        if self.read_only:
            return (
                f"the {self.label} in {self.folder} is on a read-only root and lacks "
                f"{format_size(self.needed)} of merged layers; list a writable root after it in "
                "lora.cache.roots to build them there"
            )
        limit = f", max_size {format_size(self.max_size)}" if self.max_size is not None else ""
        return (
            f"no room for the {self.label} in {self.folder}: needs {format_size(self.needed)}, "
            f"{format_size(max(self.available, 0))} available ({format_size(self.free_disk)} free on disk, "
            f"keeping {format_size(self.headroom)} headroom{limit}). Free disk space, raise max_size, "
            "or run `hostmem cache prune`."
        )
