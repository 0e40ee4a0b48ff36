"""How a build writes the layers the page cache holds: measured once per machine, disk and boot.

A build leaves the merged layers the page cache can hold in it, so that the first pass
does not read them from the disk again (:mod:`hostmem.vault.read_ahead`). Two ways get
them there and the faster one depends on the machine (:mod:`hostmem.write_way`): on one
2-core virtual machine a buffered write cost 5-8 s per GiB where ``O_DIRECT`` and the
read back cost 0.5-1; on another of the same kind, 0.8-1.5 s against 2.3-2.9 s.

:func:`write_way` answers the faster, timed on the cache root's own filesystem by
:func:`hostmem.write_way.measure` (:data:`TRIAL_BYTES` each trial, half a second) and
remembered among the kernel wisdom's facts (``<root>/kernel_wisdom.json``), under the
CPU, the filesystem's device and the boot: another disk, another machine with the same
root (an image), or a reboot measure again. A build of less than :data:`MEASURE_FROM`
bytes for the page cache does not measure, the trial costing more than it could save:
it takes what is remembered, else ``O_DIRECT``. The way changes how long a build takes,
never a byte of it: both write the same bytes and fsync them before the seal.
"""

from __future__ import annotations

import json
import os
import warnings

from hostmem.vault.read_ahead import PAGE_CACHE_SHARE, page_cache_room
from hostmem.write_way import WAYS, measure

from .wisdom import FACTS, Wisdom, machine

__all__ = ["MEASURE_FROM", "TRIAL_BYTES", "write_way"]

MEASURE_FROM = 512 * 1024 * 1024  # bytes a build leaves in the page cache before the ways are timed
TRIAL_BYTES = 32 * 1024 * 1024  # per trial file: four trials, half a second on a 2-core virtual machine
DIRECT = "direct"


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def _key(root: str) -> str:
    """What the choice is remembered under: the CPU, the root's filesystem and the boot."""
    return json.dumps([machine()["cpu"], "write way", os.stat(root).st_dev, _boot_id()], separators=(",", ":"))


def write_way(root: str | os.PathLike, nbytes: int) -> str:
    """``"buffered"`` or ``"direct"``: the faster way on this machine to write the part of
    ``nbytes`` (a build's layers) that the page cache holds, for a build under ``root``
    (a cache root, where the answer is remembered). See the module docstring."""
    root = os.fspath(root)
    wisdom, key = Wisdom(root), _key(root)
    known = wisdom.recall(key, FACTS)
    if known is None:
        if min(nbytes, int(PAGE_CACHE_SHARE * page_cache_room())) < MEASURE_FROM:
            return DIRECT
        try:
            with wisdom.recording(FACTS) as record:
                known = record(key, lambda: _measured(root))
        except OSError as error:  # a full disk, say: the build meets it too, and says so
            warnings.warn(f"{root}: could not time the ways to write a build ({error}); writing with O_DIRECT")
            return DIRECT
    return known.get("faster") if known.get("faster") in WAYS else DIRECT


def _measured(root: str) -> dict:
    choice = measure(root, TRIAL_BYTES)
    return {"faster": choice.faster, "seconds_per_gib": choice.seconds_per_gib, "trial_bytes": TRIAL_BYTES}
