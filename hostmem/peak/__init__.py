"""Peak anonymous memory of a process (and what it starts), sampled from outside it.

Modules, each with one job:

- ``tracker``: :class:`PeakTracker` and :func:`track_peak_anon`, what callers use, and
  the figures they read (:class:`PeakFigures`);
- ``sampler``: the tracker's side of the sampler process (start it, speak its line
  protocol, turn each way it fails into a :class:`PeakTrackerError`);
- ``sampler_program``: the sampler itself, run as a script in an interpreter of its own
  (standard library only, nothing of hostmem);
- ``crosscheck``: VmHWM and the memory cgroup's peak, two counters that cannot miss a
  spike, reported beside the sampled peak.
"""

from __future__ import annotations

from .tracker import (
    DEFAULT_INTERVAL_S,
    MAX_INTERVAL_S,
    MIN_INTERVAL_S,
    UNSEEN_TOLERANCE_BYTES,
    CgroupPeak,
    PeakFigures,
    PeakTracker,
    PeakTrackerError,
    parse_interval_ms,
    track_peak_anon,
)
from .tracker import __all__  # the tracker's public names are the package's
