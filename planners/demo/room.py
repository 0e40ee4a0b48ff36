"""Does the demo fit this machine? Checked before anything is written.

A demo larger than the machine does not fail cleanly: it writes until the disk is
full, or its in-place start (the merged targets anonymous, on a host without swap)
is killed by the kernel's OOM killer with the machine's other work. So the demo
states what it needs and refuses, with the figures and the largest scale that fits,
before writing its first byte.

Disk: the DiT, the text encoder, the adapter and the cache the cached starts build
(one merged copy of the LoRA targets). Memory: the in-place start holds the merged
targets as anonymous memory, plus the Python runtime (:data:`RUNTIME_ALLOWANCE`),
against the live headroom (:mod:`planners.headroom`).
"""

from __future__ import annotations

import os
import shutil

from hostmem.errors import InputError
from hostmem.units import format_size
from hostmem.vault.safety import nearest_existing

from .synthetic import TEXT_ENCODER_SHARE, dit_dims

__all__ = ["RUNTIME_ALLOWANCE", "demo_needs", "check_room"]

RUNTIME_ALLOWANCE = 1024**3  # Python, torch and hostmem of a scenario's start, with room to spare
MIN_SCALE = 8 * 1024**2  # the least DiT of a meaningful demo (planners.demo.run.parse_settings)
_DISK_MARGIN = 64 * 1024**2  # configs, results, the adapter's header, a filesystem's own blocks


def demo_needs(scale: int) -> tuple[int, int]:
    """``(disk bytes, memory bytes)`` the demo needs at a DiT of ``scale`` bytes."""
    hidden, blocks = dit_dims(scale)
    targets = blocks * 10 * hidden * hidden * 2  # what synthetic.write_synthetic_set's adapter changes
    disk = scale + int(scale * TEXT_ENCODER_SHARE) + targets + _DISK_MARGIN
    return disk, targets + RUNTIME_ALLOWANCE


def check_room(scale: int, folder: str, available_memory: int | None = None) -> None:
    """Raise ValueError, with the figures, when the demo at ``scale`` will not fit under ``folder``."""
    if available_memory is None:
        from planners.headroom import read_headroom

        available_memory = read_headroom().bytes
    disk_free = shutil.disk_usage(nearest_existing(os.path.abspath(folder))).free
    disk, memory = demo_needs(scale)
    short = []
    if disk > disk_free:
        short.append(f"{format_size(disk)} of disk under {folder} (free: {format_size(disk_free)})")
    if memory > available_memory:
        short.append(f"{format_size(memory)} of memory for the in-place start (available: "
                     f"{format_size(available_memory)})")
    if short:
        fits = max(0, min(scale * disk_free // disk, scale * max(0, available_memory - RUNTIME_ALLOWANCE)
                          // max(1, memory - RUNTIME_ALLOWANCE)))
        smaller = f"Choose --scale {format_size(fits)} or less, or " if fits >= MIN_SCALE else "Free some, or choose "
        raise InputError(f"--scale {format_size(scale)}: the demo needs {' and '.join(short)}; nothing was "
                         f"written. {smaller}--workdir on a larger (and writable) disk")
