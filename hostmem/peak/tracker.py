"""Peak anonymous memory of a process, sampled from outside it.

The failure hostmem exists to prevent allocates nothing an allocation profiler sees:
a copy-on-write fault into a private checkpoint mapping just turns a page anonymous.
Only the kernel's own counter shows it, so the tracker samples RssAnon (plus RssShmem
when asked) of a process, and optionally of its descendants, and keeps the peak::

    with hostmem.track_peak_anon() as peak:
        merge_lora_in_place(model)
    print(peak.peak_bytes, peak.baseline_bytes, peak.growth_bytes, peak.samples)

Why a separate process. An in-process thread needs the GIL to take a sample, and
the code under test may hold it for the whole spike (a C loop that never releases
it, a long torch call that keeps it), so a thread can miss exactly the spikes that
matter. The sampler (:mod:`hostmem.peak.sampler_program`, driven through
:mod:`hostmem.peak.sampler`) is a small interpreter of its own that reads the
process's statm every ``interval_s`` (default 1 ms). A sample costs a few
microseconds of reading plus a 1 ms sleep in ``select``, which also watches for
commands from the tracker; the sampler uses 3-6% of one core.
Because the machines this runs on have two cores shared with other jobs, the sampler
asks for SCHED_FIFO where it may (root, CAP_SYS_NICE or an RLIMIT_RTPRIO), else for
nice -10: measured with four CPU hogs on two cores, the longest gap between samples
was 4 ms under SCHED_FIFO and 16-22 ms at normal or nice -10 priority.
``max_gap_s`` (and ``sampler_priority``) say how well it kept the rhythm in each
run: a spike shorter than the longest gap between two samples could have been missed.

Every figure read while the tracker runs is fetched from the sampler on the spot,
after a fresh sample, so a figure read while memory is held always includes it.

Two counters that cannot miss a spike, VmHWM and the memory cgroup's peak, are
reported beside the sampled peak (:mod:`hostmem.peak.crosscheck`).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator, NamedTuple

from ..errors import InputError
from .crosscheck import UNSEEN_TOLERANCE_BYTES, CgroupPeak, CrossChecks
from .sampler import PeakTrackerError, SamplerProcess
from ..units import format_size

__all__ = [
    "DEFAULT_INTERVAL_S",
    "MIN_INTERVAL_S",
    "MAX_INTERVAL_S",
    "UNSEEN_TOLERANCE_BYTES",
    "PeakTrackerError",
    "PeakFigures",
    "CgroupPeak",
    "PeakTracker",
    "track_peak_anon",
    "parse_interval_ms",
]

DEFAULT_INTERVAL_S = 0.001
MIN_INTERVAL_S = 0.0001  # the sampler may run at real-time priority: shorter would busy a core
MAX_INTERVAL_S = 10.0
_DEFAULT_TIMELINE_POINTS = 1000


def parse_interval_ms(value: str | float | int | None, name: str = "--interval") -> float:
    """Return a sampling interval given in milliseconds as seconds; None gives the default.

    ``name`` is how the person gave it (an option, a marker keyword), so that the
    error says where to look. Raises ``ValueError`` for a value that is not a number
    or lies outside what the tracker accepts.
    """
    if value is None:
        return DEFAULT_INTERVAL_S
    try:
        ms = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{name} {value!r}: not a number of milliseconds (e.g. {name} 1)") from None
    if not MIN_INTERVAL_S * 1000 <= ms <= MAX_INTERVAL_S * 1000:
        raise InputError(
            f"{name} {value!r}: must lie between {MIN_INTERVAL_S * 1000:g} and {MAX_INTERVAL_S * 1000:g} "
            "milliseconds (1 catches a 20 ms spike)"
        )
    return ms / 1000


class PeakFigures(NamedTuple):
    """What the sampler saw, in bytes and seconds since the first sample.

    ``last_bytes`` is the latest sample; ``rss_peak_bytes`` the largest VmRSS of the
    tracked process itself (to compare with VmHWM); ``processes`` counts every
    process sampled at some point (the tracked one and the descendants found);
    ``max_gap_s`` is the longest time two consecutive samples' reads may lie apart
    (from the start of one's reads to the end of the next one's: a stall between
    taking the time and reading counts) and ``max_gap_t_s`` when it ended;
    ``sampler_cpu_s`` is the CPU time the sampler spent since the first sample (its
    start-up excluded); ``start_monotonic`` is ``time.monotonic()`` at the first sample.
    """

    peak_bytes: int
    baseline_bytes: int
    last_bytes: int
    samples: int
    duration_s: float
    peak_t_s: float
    max_gap_s: float
    rss_peak_bytes: int
    processes: int
    sampler_cpu_s: float
    sampler_priority: str
    max_gap_t_s: float
    start_monotonic: float
    timeline: tuple[tuple[float, int], ...]

    @property
    def growth_bytes(self) -> int:
        """Peak minus the figure at the first sample (never negative)."""
        return max(0, self.peak_bytes - self.baseline_bytes)

    @classmethod
    def from_report(cls, report: dict) -> "PeakFigures":
        """Figures from one report of the sampler (see ``Sampling.report`` in the program)."""
        return cls(
            peak_bytes=int(report["peak"]),
            baseline_bytes=int(report["baseline"]),
            last_bytes=int(report["last"]),
            samples=int(report["samples"]),
            duration_s=float(report["duration"]),
            peak_t_s=float(report["peak_t"]),
            max_gap_s=float(report["max_gap"]),
            rss_peak_bytes=int(report["rss_peak"]),
            processes=int(report["processes"]),
            sampler_cpu_s=float(report["cpu_s"]),
            sampler_priority=str(report["priority"]),
            max_gap_t_s=float(report["max_gap_t"]),
            start_monotonic=float(report["t0"]),
            timeline=tuple((float(t), int(v)) for t, v in report["timeline"]),
        )


class PeakTracker:
    """Peak anonymous memory of ``pid`` (default: this process) between start and stop.

    ``interval_s``: time between samples (default 1 ms, enough for a 20 ms spike).
    ``children``: add every descendant's figure to the sample (a tree scan: found by
    ppid every 5 ms; a grandchild whose parent died before a scan saw it is lost),
    each process's proportional share while there are several (pages forks share, once).
    ``group``: a memory cgroup (:class:`hostmem.cgroup_sandbox.MemoryCgroup`) that
    ``pid`` runs in; each sample is then the group's own anonymous figure, which
    counts every process in it once per page, re-parented daemons included.
    ``include_shmem``: count RssShmem too (tmpfs, /dev/shm, shared anonymous memory).
    ``reset_hwm``: reset the process's VmHWM at start so that ``hwm_bytes`` is the
    peak of this run; other readers of that process's VmHWM see the reset too.

    Figures read while the tracker runs are fetched from the sampler on the spot.
    """

    def __init__(
        self,
        pid: int | None = None,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        children: bool = False,
        include_shmem: bool = False,
        reset_hwm: bool = True,
        timeline_points: int = _DEFAULT_TIMELINE_POINTS,
        group=None,
    ):
        if not MIN_INTERVAL_S <= interval_s <= MAX_INTERVAL_S:
            raise InputError(
                f"interval_s={interval_s!r}: must lie between {MIN_INTERVAL_S} and {MAX_INTERVAL_S:g} seconds "
                "(the sampler may run at real-time priority; a shorter interval would busy a core)"
            )
        if timeline_points < 2:
            raise InputError(f"timeline_points={timeline_points!r}: must be at least 2")
        self.pid = os.getpid() if pid is None else int(pid)
        self.interval_s = float(interval_s)
        self.group = group
        self.children = bool(children) or group is not None
        self.include_shmem = bool(include_shmem)
        self.reset_hwm = bool(reset_hwm)
        self.timeline_points = int(timeline_points)
        self._sampler: SamplerProcess | None = None
        self._figures: PeakFigures | None = None
        self._checks = CrossChecks(self.pid, self.reset_hwm)
        self._started = False

    # -- running ----------------------------------------------------------------

    def prepare(self) -> "PeakTracker":
        """Start the sampler interpreter without sampling yet (see ``start``)."""
        if self._sampler is None:
            self._sampler = SamplerProcess(
                self.interval_s, self.children, self.include_shmem, self.timeline_points, self.group
            )
        return self

    def start(self, pid: int | None = None) -> "PeakTracker":
        """Take the baseline and begin sampling; returns once the baseline is in.

        ``pid`` may be given here when the process did not exist at construction
        (``hostmem guard`` prepares the sampler first, then starts the command).
        """
        if self.running:
            raise PeakTrackerError(f"tracker of pid {self.pid} is already running; stop it first")
        if pid is not None:
            self.pid = int(pid)
        self.prepare()
        self._checks = CrossChecks(self.pid, self.reset_hwm)
        self._checks.begin()
        try:
            self._figures = PeakFigures.from_report(self._sampler.begin(self.pid))
        except BaseException:
            self._release()
            raise
        self._started = True
        return self

    def stop(self) -> "PeakTracker":
        """Take a last sample, end the sampler and read the cross-checks."""
        if not self.running:
            self._release()  # prepared but never started: nothing was sampled
            return self
        try:
            self._figures = PeakFigures.from_report(self._sampler.request("stop"))
        finally:
            self._checks.end()
            self._release()
        return self

    def _release(self) -> None:
        self._started = False
        self._checks.release()
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None

    @property
    def running(self) -> bool:
        return self._started

    @property
    def counting(self) -> str:
        """How processes are counted: "memory cgroup", "tree scan" or "one process"."""
        if self.group is not None:
            return "memory cgroup"
        return "tree scan" if self.children else "one process"

    @property
    def sampler_pid(self) -> int | None:
        """The sampler process's pid while it exists (prepared or running), else None."""
        return self._sampler.pid if self._sampler is not None else None

    def __enter__(self) -> "PeakTracker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self):
        if getattr(self, "_sampler", None) is not None:
            try:
                self._release()
            except Exception:
                pass

    # -- figures ----------------------------------------------------------------

    def figures(self) -> PeakFigures:
        """The current figures: fetched from the sampler while running, else the last."""
        if self.running:
            self._figures = PeakFigures.from_report(self._sampler.request("snap"))
        if self._figures is None:
            raise PeakTrackerError(f"tracker of pid {self.pid} has not been started: call start() or use it in 'with'")
        return self._figures

    @property
    def peak_bytes(self) -> int:
        return self.figures().peak_bytes

    @property
    def baseline_bytes(self) -> int:
        return self.figures().baseline_bytes

    @property
    def growth_bytes(self) -> int:
        return self.figures().growth_bytes

    @property
    def samples(self) -> int:
        return self.figures().samples

    @property
    def timeline(self) -> list[tuple[float, int]]:
        """(seconds since the first sample, bytes): the largest sample per time bucket."""
        return list(self.figures().timeline)

    @property
    def peak_t_s(self) -> float:
        return self.figures().peak_t_s

    @property
    def duration_s(self) -> float:
        return self.figures().duration_s

    @property
    def max_gap_s(self) -> float:
        return self.figures().max_gap_s

    # -- cross-checks (read at stop) ---------------------------------------------

    @property
    def hwm_bytes(self) -> int | None:
        """VmHWM at stop, reset at start; None when this tracker did not own the reset."""
        return self._checks.hwm_bytes

    @property
    def cgroup(self) -> CgroupPeak | None:
        """The memory cgroup's peak counter at start and stop, where the cgroup has one."""
        return self._checks.cgroup

    @property
    def unseen_rss_bytes(self) -> int | None:
        """How far VmHWM rose above every RSS sampled, beyond counter noise (0: nothing missed).

        Differences under ``UNSEEN_TOLERANCE_BYTES`` are counted as 0; what remains
        is a spike that fell between samples.
        """
        if self._figures is None:
            return None
        return self._checks.unseen_rss_bytes(self._figures.rss_peak_bytes)

    def cross_check_text(self) -> str:
        """What the counters that cannot miss a spike say, and what they count."""
        return self._checks.text(self._figures.rss_peak_bytes if self._figures is not None else -1)

    # -- reports ------------------------------------------------------------------

    def to_dict(self) -> dict:
        """JSON-safe figures, sizes in bytes."""
        fig = self.figures()
        return {
            "pid": self.pid,
            "peak_anon_bytes": fig.peak_bytes,
            "baseline_anon_bytes": fig.baseline_bytes,
            "growth_anon_bytes": fig.growth_bytes,
            "samples": fig.samples,
            "duration_s": round(fig.duration_s, 6),
            "peak_t_s": round(fig.peak_t_s, 6),
            "interval_s": self.interval_s,
            "max_gap_s": round(fig.max_gap_s, 6),
            "include_shmem": self.include_shmem,
            "children": self.children,
            "counting": self.counting,
            "processes": fig.processes,
            "sampler_cpu_s": round(fig.sampler_cpu_s, 6),
            "sampler_priority": fig.sampler_priority,
            "hwm_bytes": self.hwm_bytes,
            "unseen_rss_bytes": self.unseen_rss_bytes,
            "cgroup_peak": self.cgroup.to_dict() if self.cgroup else None,
            "timeline": [[round(t, 6), v] for t, v in fig.timeline],
        }

    def summary(self) -> str:
        """One line for people: peak, baseline, growth, when, how densely sampled."""
        fig = self.figures()
        what = "anonymous+shmem" if self.include_shmem else "anonymous"
        return (
            f"peak {what} {format_size(fig.peak_bytes)} (baseline {format_size(fig.baseline_bytes)}, "
            f"growth {format_size(fig.growth_bytes)}) at {fig.peak_t_s:.3f} s of {fig.duration_s:.3f} s; "
            f"{fig.samples} samples every {self.interval_s * 1000:g} ms, longest gap {fig.max_gap_s * 1000:.1f} ms"
        )


@contextmanager
def track_peak_anon(
    pid: int | None = None,
    *,
    interval_s: float = DEFAULT_INTERVAL_S,
    children: bool = False,
    include_shmem: bool = False,
    reset_hwm: bool = True,
) -> Iterator[PeakTracker]:
    """Track the peak anonymous memory of ``pid`` (default: this process) in a block.

    ``with track_peak_anon() as peak: ...`` then ``peak.peak_bytes``,
    ``peak.baseline_bytes``, ``peak.growth_bytes``, ``peak.samples``, ``peak.timeline``.
    """
    tracker = PeakTracker(
        pid, interval_s=interval_s, children=children, include_shmem=include_shmem, reset_hwm=reset_hwm
    )
    tracker.start()
    try:
        yield tracker
    finally:
        tracker.stop()
