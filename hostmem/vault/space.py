"""Room for a build: what it needs against what the disk and ``max_size`` allow."""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from hostmem.units import format_size

from .layer_file import layer_file_bytes

__all__ = ["SpaceCheck", "full_disk_advice", "still_needed"]


def still_needed(entries: dict, expected: dict | None) -> int:
    """Bytes of the expected layers (``{name: (shape, dtype)}``) not among ``entries`` (the sealed ones)."""
    return sum(layer_file_bytes(s, d) for n, (s, d) in (expected or {}).items() if n not in entries)


def full_disk_advice(exc: BaseException, folder: str) -> str:
    """What to do about ``exc`` where it is a full disk or quota (ENOSPC, EDQUOT, itself or
    its cause), as a sentence naming what is left on ``folder``'s filesystem; else ``""``."""
    while exc is not None and getattr(exc, "errno", None) not in (errno.ENOSPC, errno.EDQUOT):
        exc = exc.__cause__
    if exc is None:
        return ""
    try:
        st = os.statvfs(folder)
        left = f"{format_size(st.f_bavail * st.f_frsize)} left on the filesystem of {folder}"
    except OSError:
        left = f"the filesystem of {folder} is full"
    return (f" ({left}; it filled during the build). Free disk space there, lower max_size "
            "(lora.cache.max_size) so that older combinations are evicted to make room, or run "
            "`hostmem cache prune`")


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
