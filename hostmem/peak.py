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
matter. The sampler is a small interpreter of its own (standard library only, no
torch, started with ``-I -S``: about 15 ms to start) that keeps ``/proc/PID/statm``
open and reads it with ``pread`` every ``interval_s`` (default 1 ms): anonymous
bytes are statm's resident minus shared, the same counters /proc/PID/status prints
as RssAnon, at a fifth of its cost. With ``include_shmem`` it reads status instead.
A sample costs a few microseconds of reading plus a 1 ms sleep in ``select``, which
also watches for commands from the tracker; the sampler uses 3-6% of one core.
Because the machines this runs on have two cores shared with other jobs, the sampler
asks for SCHED_FIFO where it may (root, CAP_SYS_NICE or an RLIMIT_RTPRIO), else for
nice -10: measured with four CPU hogs on two cores, the longest gap between samples
was 4 ms under SCHED_FIFO and 16-22 ms at normal or nice -10 priority.
``max_gap_s`` (and ``sampler_priority``) say how well it kept the rhythm in each
run: a spike shorter than the longest gap between two samples could have been missed.

Two cross-checks that cannot miss a spike are reported beside the sampled peak, each
saying what it counts:

- ``hwm_bytes``: the process's VmHWM, reset at start (``5`` written to
  ``/proc/PID/clear_refs``). It is the peak of *all* resident pages (file and shmem
  included), so it bounds nothing about anonymous memory alone, but if it exceeds
  every RSS the sampler saw (``unseen_rss_bytes``) a spike fell between two samples.
- ``cgroup``: the memory cgroup's peak counter (v1 ``memory.max_usage_in_bytes``,
  v2 ``memory.peak``), which counts page cache and every process in the group and
  is not reset here, so it only says something when it rose during tracking.
"""

from __future__ import annotations

import inspect
import json
import os
import select
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from .procfs import ProcReadError, memory_cgroup_dir, proc_path, read_cgroup_v1_dir, read_cgroup_v2_dir, read_status
from .units import format_size

__all__ = [
    "DEFAULT_INTERVAL_S",
    "MIN_INTERVAL_S",
    "UNSEEN_TOLERANCE_BYTES",
    "PeakTrackerError",
    "PeakFigures",
    "CgroupPeak",
    "PeakTracker",
    "track_peak_anon",
]

DEFAULT_INTERVAL_S = 0.001
MIN_INTERVAL_S = 0.0001
UNSEEN_TOLERANCE_BYTES = 4 * 1024 * 1024
_REPLY_TIMEOUT_S = 30.0  # generous: a loaded CI machine may starve the sampler for seconds
_DEFAULT_TIMELINE_POINTS = 1000


class PeakTrackerError(ProcReadError):
    """The sampler could not start, could not read the process, or stopped answering."""


# ---------------------------------------------------------------------------------
# The sampler. Everything in this section runs in the sampler interpreter, which is
# started with -I -S and gets only these definitions (see _sampler_program): it may
# use os, select, sys and time, and nothing else of this module.
# ---------------------------------------------------------------------------------


class _Sampling:
    """State of one sampling run: open /proc files, the peak, the timeline."""

    def __init__(self, root, shmem, children, points, rescan):
        self.root, self.shmem = root, shmem
        self.children, self.points, self.rescan_every = children, points, rescan
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.own_pid = os.getpid()
        self.fds = {}
        self.processes = 0
        self.unrelated = set()
        self.seen = set()
        self.peak = self.baseline = self.last = self.rss_peak = -1
        self.samples = 0
        self.t0 = self.peak_t = self.last_t = 0.0
        self.max_gap = self.max_gap_t = 0.0
        self.width = 0.005
        self.timeline = []
        self.bucket = [-1, 0.0, -1]
        self.next_rescan = self.cpu0 = 0.0
        self.priority = "normal"
        self.open_pid(root)

    def open_pid(self, pid):
        """Open the /proc file of ``pid`` once; every sample then costs one pread."""
        name = "status" if self.shmem else "statm"
        self.fds[pid] = os.open(f"/proc/{pid}/{name}", os.O_RDONLY)
        self.seen.add(pid)
        self.processes += 1

    def read_pid(self, pid, fd):
        """Return (anonymous, resident) bytes of ``pid``, or None once it is gone."""
        try:
            data = os.pread(fd, 4096, 0)
        except OSError:
            return None
        if not data:
            return None
        if not self.shmem:
            fields = data.split()
            resident, shared = int(fields[1]), int(fields[2])
            return (resident - shared) * self.page, resident * self.page
        return self.status_field(data, b"RssAnon:") + self.status_field(data, b"RssShmem:"), self.status_field(
            data, b"VmRSS:"
        )

    @staticmethod
    def status_field(data, key):
        """Bytes of one ``Key: N kB`` line; 0 when absent (a zombie has no memory lines)."""
        at = data.find(key)
        if at < 0:
            return 0
        return int(data[at + len(key) : data.index(b"kB", at)]) * 1024

    def sample(self):
        """Read every tracked process once and fold the sum into the figures."""
        now = time.monotonic()
        anon = 0
        for pid, fd in list(self.fds.items()):
            got = self.read_pid(pid, fd)
            if got is None:
                os.close(self.fds.pop(pid))
                continue
            anon += got[0]
            if pid == self.root and got[1] > self.rss_peak:
                self.rss_peak = got[1]
        if self.samples == 0:
            self.t0, self.baseline, self.peak, self.last_t = now, anon, anon, now
            self.cpu0 = time.process_time()
        t = now - self.t0
        if now - self.last_t > self.max_gap:
            self.max_gap, self.max_gap_t = now - self.last_t, t
        self.last_t, self.last = now, anon
        self.samples += 1
        if anon > self.peak:
            self.peak, self.peak_t = anon, t
        self.add_point(t, anon)

    def add_point(self, t, value):
        """Keep the largest value per time bucket; widen buckets to stay under ``points``."""
        index = int(t / self.width)
        if index == self.bucket[0]:
            if value > self.bucket[2]:
                self.bucket[1], self.bucket[2] = t, value
            return
        if self.bucket[0] >= 0:
            self.timeline.append((self.bucket[1], self.bucket[2]))
        self.bucket = [index, t, value]
        if len(self.timeline) >= self.points:
            self.width *= 2
            merged = []
            for point in self.timeline:
                if merged and int(merged[-1][0] / self.width) == int(point[0] / self.width):
                    if point[1] > merged[-1][1]:
                        merged[-1] = point
                else:
                    merged.append(point)
            self.bucket[0] = int(self.bucket[1] / self.width)
            if merged and int(merged[-1][0] / self.width) == self.bucket[0]:
                last_t, last_v = merged.pop()
                if last_v >= self.bucket[2]:
                    self.bucket[1], self.bucket[2] = last_t, last_v
            self.timeline = merged

    def rescan(self, now):
        """Find new descendants of the root: /proc entries not seen before, by ppid."""
        if now < self.next_rescan:
            return
        self.next_rescan = now + self.rescan_every
        present = {int(n) for n in os.listdir("/proc") if n.isdigit()}
        self.unrelated &= present
        self.seen &= present
        parents = {}
        for pid in present - self.unrelated - self.seen:
            try:
                with open(f"/proc/{pid}/stat", "rb") as handle:
                    parents[pid] = int(handle.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
        tree = set(self.fds) | {self.root}
        changed = True
        while changed:
            changed = False
            for pid, ppid in list(parents.items()):
                if ppid in tree and pid != self.own_pid:
                    tree.add(pid)
                    del parents[pid]
                    changed = True
                    try:
                        self.open_pid(pid)
                    except OSError:
                        pass
        self.unrelated.update(parents)

    def report(self):
        """One JSON line (written by hand: importing json costs the sampler 7 ms)."""
        points = self.timeline + ([(self.bucket[1], self.bucket[2])] if self.bucket[0] >= 0 else [])
        line = ",".join("[%.6f,%d]" % point for point in points)
        return (
            '{"peak": %d, "peak_t": %.6f, "baseline": %d, "last": %d, "samples": %d, "t0": %.6f,'
            ' "duration": %.6f, "max_gap": %.6f, "max_gap_t": %.6f, "rss_peak": %d, "processes": %d, "cpu_s": %.6f,'
            ' "priority": "%s", "timeline": [%s]}\n'
            % (
                self.peak, self.peak_t, self.baseline, self.last, self.samples, self.t0,
                self.last_t - self.t0, self.max_gap, self.max_gap_t, self.rss_peak, self.processes,
                time.process_time() - self.cpu0, self.priority, line,
            )
        ).encode()


def _sampler_raise_priority():
    """Ask for the highest priority allowed, so that busy CPUs do not starve the sampler.

    SCHED_FIFO (needs CAP_SYS_NICE or an RLIMIT_RTPRIO) wakes it within ~1 ms even
    with every core busy; nice -10 still lets a busy core delay it by 20 ms. The
    sampler sleeps between samples, so the real-time class costs others ~3% of a core.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        return "fifo"
    except (OSError, AttributeError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -10)
        return "nice-10"
    except OSError:
        return "normal"


def _sampler_main():
    """Sample until told to stop: ``begin PID``, then ``snap`` or ``stop`` on stdin."""
    opts = dict(arg.split("=", 1) for arg in sys.argv[1:])
    priority = _sampler_raise_priority()
    buffer = b""
    while b"\n" not in buffer:
        chunk = os.read(0, 4096)
        if not chunk:
            return
        buffer += chunk
    line, buffer = buffer.split(b"\n", 1)
    root = int(line.split()[1])
    interval = float(opts["interval"])
    try:
        state = _Sampling(
            root, opts["shmem"] == "1", opts["children"] == "1", int(opts["points"]), float(opts["rescan"])
        )
    except OSError as exc:
        os.write(1, ("error %s: %s\n" % (exc.filename or "/proc/%d" % root, exc.strerror or exc)).encode())
        return
    state.priority = priority
    if state.children:
        state.rescan(time.monotonic())
    state.sample()
    os.write(1, state.report())
    while True:
        ready = b"\n" in buffer or select.select([0], [], [], interval)[0]
        if state.children:
            state.rescan(time.monotonic())
        state.sample()
        if not ready:
            continue
        if b"\n" not in buffer:
            chunk = os.read(0, 4096)
            if not chunk:
                return
            buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            os.write(1, state.report())
            if line.strip() == b"stop":
                return


_SAMPLER_PARTS = (_Sampling, _sampler_raise_priority, _sampler_main)

# --------------------------------------------------------------- end of the sampler


_program_cache: list[str] = []


def _sampler_program() -> str:
    """The sampler's source: the definitions above, then a call of ``_sampler_main``."""
    if not _program_cache:
        parts = [inspect.getsource(part) for part in _SAMPLER_PARTS]
        _program_cache.append("import os, select, sys, time\n\n" + "\n\n".join(parts) + "\n_sampler_main()\n")
    return _program_cache[0]


class _SamplerProcess:
    """The tracker's side of the sampler: start it, talk to it, end it."""

    def __init__(self, interval_s: float, children: bool, include_shmem: bool, points: int):
        args = [
            f"interval={interval_s!r}",
            f"shmem={int(include_shmem)}",
            f"children={int(children)}",
            f"points={int(points)}",
            f"rescan={max(interval_s, 0.005)!r}",
        ]
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _sampler_program(), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self._pending = b""

    def begin(self, pid: int) -> dict:
        """Point the sampler at ``pid``; returns the first report (the baseline)."""
        return self.request(f"begin {pid}")

    def request(self, command: str) -> dict:
        """Send one command line and return the sampler's report."""
        try:
            self.proc.stdin.write(command.encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise PeakTrackerError(f"peak sampler (pid {self.proc.pid}) has exited: {self._stderr()}") from None
        line = self._read_line()
        if line.startswith(b"error "):
            self.close()
            raise PeakTrackerError(
                f"{line[6:].decode().strip()} (is the process still running, and may this user read its /proc?)"
            )
        return json.loads(line)

    def _read_line(self) -> bytes:
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + _REPLY_TIMEOUT_S
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.close()
                raise PeakTrackerError(f"peak sampler gave no answer within {_REPLY_TIMEOUT_S:.0f} s; stopped it")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise PeakTrackerError(f"peak sampler exited without an answer: {self._stderr()}")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line

    def _stderr(self) -> str:
        try:
            self.proc.wait(timeout=5)
            text = self.proc.stderr.read().decode(errors="replace").strip()
        except (subprocess.TimeoutExpired, ValueError, OSError):
            text = ""
        return text.splitlines()[-1] if text else f"exit status {self.proc.returncode}"

    def close(self) -> None:
        """End the sampler (closing its stdin ends it; kill only if it does not)."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass  # already broken: the sampler has gone
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()


@dataclass(frozen=True)
class PeakFigures:
    """What the sampler saw, in bytes and seconds since the first sample.

    ``last_bytes`` is the latest sample; ``rss_peak_bytes`` the largest VmRSS of the
    tracked process itself (to compare with VmHWM); ``processes`` counts every
    process sampled at some point (the tracked one and the descendants found);
    ``max_gap_s`` is the longest time between two samples and ``max_gap_t_s`` when
    it ended; ``sampler_cpu_s`` is the CPU time the sampler spent since the first
    sample (its start-up excluded); ``start_monotonic`` is ``time.monotonic()`` at
    the first sample.
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


@dataclass(frozen=True)
class CgroupPeak:
    """The memory cgroup's own peak counter, read at start and at stop.

    It counts page cache and every process in the group, and hostmem does not reset
    it (that would disturb anyone else reading it), so it says something about the
    tracked run only when it rose between start and stop (``rose``).
    """

    version: int
    path: str
    peak_at_start_bytes: int
    peak_bytes: int
    usage_at_start_bytes: int
    includes: str = "page cache and every process in the group; not reset at start"

    @property
    def rose(self) -> bool:
        return self.peak_bytes > self.peak_at_start_bytes

    def to_dict(self) -> dict:
        return {
            "version": self.version,
            "path": self.path,
            "peak_bytes": self.peak_bytes,
            "peak_at_start_bytes": self.peak_at_start_bytes,
            "usage_at_start_bytes": self.usage_at_start_bytes,
            "rose": self.rose,
            "includes": self.includes,
        }


_hwm_owners: set[int] = set()  # pids whose VmHWM a running tracker here has reset


class PeakTracker:
    """Peak anonymous memory of ``pid`` (default: this process) between start and stop.

    ``interval_s``: time between samples (default 1 ms, enough for a 20 ms spike).
    ``children``: add every descendant's figure to the sample (found by ppid every
    5 ms; a grandchild whose parent died first is reparented away and lost).
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
    ):
        if not MIN_INTERVAL_S <= interval_s <= 10:
            raise ValueError(
                f"interval_s={interval_s!r}: must lie between {MIN_INTERVAL_S} and 10 seconds "
                "(the sampler may run at real-time priority; a shorter interval would busy a core)"
            )
        if timeline_points < 2:
            raise ValueError(f"timeline_points={timeline_points!r}: must be at least 2")
        self.pid = os.getpid() if pid is None else int(pid)
        self.interval_s = float(interval_s)
        self.children = bool(children)
        self.include_shmem = bool(include_shmem)
        self.reset_hwm = bool(reset_hwm)
        self.timeline_points = int(timeline_points)
        self._sampler: _SamplerProcess | None = None
        self._figures: PeakFigures | None = None
        self._owns_hwm = False
        self._started = False
        self._cgroup_start: tuple | None = None
        self.hwm_bytes: int | None = None
        self.cgroup: CgroupPeak | None = None

    # -- running ----------------------------------------------------------------

    def prepare(self) -> "PeakTracker":
        """Start the sampler interpreter without sampling yet (see ``start``)."""
        if self._sampler is None:
            self._sampler = _SamplerProcess(self.interval_s, self.children, self.include_shmem, self.timeline_points)
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
        self.hwm_bytes, self.cgroup = None, None
        self._cgroup_start = self._read_cgroup_start()
        self._owns_hwm = self.reset_hwm and _reset_hwm(self.pid)
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
            if self._owns_hwm:
                self.hwm_bytes = _read_hwm(self.pid)
            self.cgroup = self._read_cgroup_stop()
            self._release()
        return self

    def _release(self) -> None:
        self._started = False
        if self._owns_hwm:
            _hwm_owners.discard(self.pid)
            self._owns_hwm = False
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None

    @property
    def running(self) -> bool:
        return self._started

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

    @property
    def unseen_rss_bytes(self) -> int | None:
        """How far VmHWM rose above every RSS sampled, beyond counter noise (0: nothing missed).

        The kernel's RSS counters are per-CPU and read approximately, and RSS moves a
        little between two samples, so differences under ``UNSEEN_TOLERANCE_BYTES``
        are counted as 0; what remains is a spike that fell between samples.
        """
        if self.hwm_bytes is None or self._figures is None or self._figures.rss_peak_bytes < 0:
            return None
        unseen = self.hwm_bytes - self._figures.rss_peak_bytes
        return unseen if unseen > UNSEEN_TOLERANCE_BYTES else 0

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

    def cross_check_text(self) -> str:
        """What the counters that cannot miss a spike say, and what they count."""
        parts = []
        if self.hwm_bytes is not None:
            unseen = self.unseen_rss_bytes or 0
            parts.append(
                f"VmHWM {format_size(self.hwm_bytes)} (all resident pages, file-backed included"
                + (f"; {format_size(unseen)} above any sampled RSS: a spike fell between samples)" if unseen else ")")
            )
        if self.cgroup is not None:
            parts.append(
                f"memory cgroup v{self.cgroup.version} peak {format_size(self.cgroup.peak_bytes)} "
                f"({'rose during the run' if self.cgroup.rose else 'set before the run'}; counts "
                f"{self.cgroup.includes})"
            )
        return "; ".join(parts) if parts else "no cross-check available"

    # -- cross-checks -------------------------------------------------------------

    def _read_cgroup_start(self) -> tuple | None:
        try:
            found = memory_cgroup_dir(self.pid)
            if found is None or not os.path.isdir(found[1]):
                return None
            reading = _read_cgroup(found)
        except (ProcReadError, OSError, ValueError):
            return None
        if reading.peak_bytes is None:
            return None
        return found, reading.peak_bytes, reading.usage_bytes

    def _read_cgroup_stop(self) -> CgroupPeak | None:
        if self._cgroup_start is None:
            return None
        found, peak_at_start, usage_at_start = self._cgroup_start
        try:
            reading = _read_cgroup(found)
        except (ProcReadError, OSError, ValueError):
            return None
        if reading.peak_bytes is None:
            return None
        return CgroupPeak(found[0], found[1], peak_at_start, reading.peak_bytes, usage_at_start)


def _read_cgroup(found: tuple):
    version, folder, root = found
    return (read_cgroup_v1_dir if version == 1 else read_cgroup_v2_dir)(folder, root)


def _reset_hwm(pid: int) -> bool:
    """Reset VmHWM of ``pid`` unless another tracker here already did; True if we own it."""
    if pid in _hwm_owners:
        return False
    try:
        with open(proc_path(pid, "clear_refs"), "w") as handle:
            handle.write("5")
    except OSError:
        return False  # not permitted (another user's process) or a kernel without it
    _hwm_owners.add(pid)
    return True


def _read_hwm(pid: int) -> int | None:
    try:
        return read_status(pid).vm_hwm
    except ProcReadError:
        return None  # the process has exited


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
