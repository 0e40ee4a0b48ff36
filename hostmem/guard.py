"""Run a command under the peak tracker and judge its peak against a limit.

This is the body of ``hostmem guard``; the command line only parses arguments and
prints. :func:`run_guarded` starts the sampler first, then the command, so that the
first sample is the command's own (``Popen`` returns once ``exec`` has succeeded, and
sampling a forked child before that would count the guard's memory as its own).

The JSON form is a contract CI jobs parse; keys may be added, never renamed::

    {"peak_anon_bytes": int, "baseline_anon_bytes": int, "limit_bytes": int,
     "exceeded": bool, "exit_code": int, "samples": int, "duration_s": float,
     "timeline": [[t_s, bytes], ...],
     ... plus "command", "guard_exit_code", "signal", "peak_t_s", "interval_s",
     "max_gap_s", "children", "include_shmem", "processes", "max_rss_bytes",
     "sampler_priority", "cgroup_peak"}

``exit_code`` is the command's own (128 + N when signal N ended it), and
``guard_exit_code`` is what ``hostmem guard`` exits with: the command's code, or
:data:`EXIT_OVER_LIMIT` when the peak exceeded the limit and the command succeeded.
``max_rss_bytes`` is the kernel's high-water mark of the command's resident memory
(file pages included, waited-for descendants too), a figure no sampling can miss.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from dataclasses import dataclass, field

import psutil

from .peak import DEFAULT_INTERVAL_S, CgroupPeak, PeakFigures, PeakTracker, PeakTrackerError
from .units import format_size

__all__ = ["EXIT_OVER_LIMIT", "GuardResult", "run_guarded"]

EXIT_OVER_LIMIT = 3
_FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class GuardResult:
    """What a guarded run did: the command's exit, its peak, and the verdict."""

    command: tuple[str, ...]
    limit_bytes: int
    exit_code: int
    signal: int | None
    figures: PeakFigures
    interval_s: float
    children: bool
    include_shmem: bool
    max_rss_bytes: int | None = None
    cgroup: CgroupPeak | None = field(default=None)

    @property
    def exceeded(self) -> bool:
        """True when the peak anonymous memory was above the limit."""
        return self.figures.peak_bytes > self.limit_bytes

    @property
    def guard_exit_code(self) -> int:
        """The command's code, except a successful command over the limit gets 3."""
        if self.exceeded and self.exit_code == 0:
            return EXIT_OVER_LIMIT
        return self.exit_code

    def to_dict(self) -> dict:
        """The JSON contract (sizes in bytes); see the module docstring."""
        fig = self.figures
        return {
            "peak_anon_bytes": fig.peak_bytes,
            "baseline_anon_bytes": fig.baseline_bytes,
            "limit_bytes": self.limit_bytes,
            "exceeded": self.exceeded,
            "exit_code": self.exit_code,
            "samples": fig.samples,
            "duration_s": round(fig.duration_s, 6),
            "timeline": [[round(t, 6), v] for t, v in fig.timeline],
            "command": list(self.command),
            "guard_exit_code": self.guard_exit_code,
            "signal": self.signal,
            "peak_t_s": round(fig.peak_t_s, 6),
            "interval_s": self.interval_s,
            "max_gap_s": round(fig.max_gap_s, 6),
            "children": self.children,
            "include_shmem": self.include_shmem,
            "processes": fig.processes,
            "max_rss_bytes": self.max_rss_bytes,
            "sampler_priority": fig.sampler_priority,
            "cgroup_peak": self.cgroup.to_dict() if self.cgroup else None,
        }

    def verdict(self) -> str:
        """One line for a CI log: over or within, the peak, the limit and the exit."""
        fig = self.figures
        what = "anonymous+shmem" if self.include_shmem else "anonymous"
        scope = " (command and its descendants)" if self.children else ""
        head = "OVER LIMIT" if self.exceeded else "within limit"
        relation = ">" if self.exceeded else "<="
        ended = f"killed by signal {self.signal}" if self.signal else f"exited {self.exit_code}"
        return (
            f"hostmem guard: {head}: peak {what}{scope} {format_size(fig.peak_bytes)} {relation} "
            f"{format_size(self.limit_bytes)} (baseline {format_size(fig.baseline_bytes)}, peak at "
            f"{fig.peak_t_s:.2f} s of {fig.duration_s:.2f} s, {fig.samples} samples, longest gap "
            f"{fig.max_gap_s * 1000:.1f} ms); command {ended}; guard exits {self.guard_exit_code}"
        )


def run_guarded(
    command: list[str] | tuple[str, ...],
    limit_bytes: int,
    *,
    interval_s: float = DEFAULT_INTERVAL_S,
    children: bool = False,
    include_shmem: bool = False,
    env: dict | None = None,
    cwd: str | None = None,
) -> GuardResult:
    """Run ``command`` to its end while tracking its peak anonymous memory.

    The command inherits stdin, stdout and stderr. SIGTERM and SIGHUP sent to this
    process are passed on to the command and SIGINT is ignored while it runs (when
    called from the main thread), so that a cancelled CI job still ends the command
    and still gets a verdict.
    """
    command = tuple(str(part) for part in command)
    if not command:
        raise ValueError("no command given: put it after '--', e.g. hostmem guard --max-peak-anon 4GiB -- python x.py")
    if limit_bytes < 0:
        raise ValueError(f"limit_bytes={limit_bytes}: a limit is never negative")
    tracker = PeakTracker(
        interval_s=interval_s, children=children, include_shmem=include_shmem, reset_hwm=False
    ).prepare()
    try:
        proc = _start(command, env=env, cwd=cwd)
        _track(tracker, proc, command)
        with _forwarding_signals(proc):
            exit_code, sig, usage = _wait(proc)
    finally:
        tracker.stop()
    return GuardResult(
        command=command,
        limit_bytes=int(limit_bytes),
        exit_code=exit_code,
        signal=sig,
        figures=tracker.figures(),
        interval_s=tracker.interval_s,
        children=tracker.children,
        include_shmem=tracker.include_shmem,
        max_rss_bytes=usage.ru_maxrss * 1024 if usage is not None else None,
        cgroup=tracker.cgroup,
    )


def _start(command: tuple[str, ...], env: dict | None, cwd: str | None) -> subprocess.Popen:
    """Start the command; a missing program is a ValueError that names it."""
    try:
        return subprocess.Popen(list(command), env=env, cwd=cwd)
    except FileNotFoundError:
        raise ValueError(f"{command[0]}: command not found (check the name and PATH)") from None
    except PermissionError:
        raise ValueError(f"{command[0]}: permission denied (is it executable?)") from None
    except NotADirectoryError:
        raise ValueError(f"{cwd}: not a folder (the working folder for the command)") from None


def _track(tracker: PeakTracker, proc: subprocess.Popen, command: tuple[str, ...]) -> None:
    """Start tracking the command just started; if that fails, end the command first.

    A command the guard cannot track must not run on unguarded (it could eat the
    host's memory with nobody judging it), so it is killed with every descendant it
    has started and reaped before the error is raised.
    """
    try:
        tracker.start(proc.pid)
    except BaseException as exc:
        _kill_tree(proc)
        if isinstance(exc, PeakTrackerError):
            raise PeakTrackerError(
                f"could not track {command[0]} (pid {proc.pid}), so it was killed before it ran unguarded: "
                f"{exc}. Run the guard again; if this repeats, check that this user may read /proc/{proc.pid} "
                "and that the machine has memory to spare for the sampler"
            ) from exc
        raise


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the command and every descendant it has started, then reap the command.

    Each process is stopped before its children are listed, so none can fork a new
    one behind the walk; the descendants, reparented when the command dies, are
    reaped by their new parent.
    """
    stopped: list[psutil.Process] = []
    todo = [proc.pid]
    while todo:
        try:
            process = psutil.Process(todo.pop())
            process.suspend()
            stopped.append(process)
            todo.extend(child.pid for child in process.children())
        except psutil.Error:  # gone already, or not ours to stop
            continue
    for process in reversed(stopped):
        try:
            process.kill()
        except psutil.Error:
            pass
    proc.wait()


def _wait(proc: subprocess.Popen) -> tuple[int, int | None, object]:
    """Reap the command with wait4, which also gives its high-water mark of RSS.

    Returns (exit code, signal or None, rusage or None).
    """
    while True:
        try:
            _, status, usage = os.wait4(proc.pid, 0)
            break
        except InterruptedError:
            continue
        except ChildProcessError:  # reaped elsewhere (SIGCHLD ignored): no rusage
            code = proc.wait()
            return (128 - code, -code, None) if code < 0 else (code, None, None)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status), os.WTERMSIG(status), usage
    return os.WEXITSTATUS(status), None, usage


class _forwarding_signals:
    """Pass SIGTERM and SIGHUP on to the command while it runs, and outlive SIGINT.

    A Ctrl-C at a terminal reaches the command directly (same process group), so the
    guard ignores SIGINT instead of sending a second one, then reports as usual.
    """

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.saved: dict = {}

    def _forward(self, signum, frame) -> None:
        if self.proc.returncode is None:
            try:
                self.proc.send_signal(signum)
            except ProcessLookupError:
                pass

    def __enter__(self) -> "_forwarding_signals":
        if threading.current_thread() is threading.main_thread():
            for signum in _FORWARDED_SIGNALS:
                self.saved[signum] = signal.signal(signum, self._forward)
            self.saved[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self.saved.items():
            signal.signal(signum, handler)
