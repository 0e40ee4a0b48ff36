"""Run a command under the peak tracker and judge its peak against a limit.

This is the body of ``hostmem guard``; the command line only parses arguments and
prints. :func:`run_guarded` starts the sampler first, then the command, so that the
first sample is the command's own (``Popen`` returns once ``exec`` has succeeded, and
sampling a forked child before that would count the guard's memory as its own).

What is counted. A server started by a shell script does its work in a child, so by
default the whole tree is counted: where the machine allows it, the command runs in
a memory cgroup of its own, nested under the guard's (exact: each page once, and a
daemon that re-parents away stays in the group), and each sample is that group's
anonymous figure; elsewhere a tree scan sums every live descendant's proportional share
(Pss_Anon: a page a fork left shared counts once).
``children=False`` counts the command's own process only.

The JSON form is a contract CI jobs parse; keys may be added, never renamed::

    {"peak_anon_bytes": int, "baseline_anon_bytes": int, "limit_bytes": int,
     "exceeded": bool, "exit_code": int, "samples": int, "duration_s": float,
     "timeline": [[t_s, bytes], ...],
     ... plus "command", "guard_exit_code", "signal", "peak_t_s", "interval_s",
     "max_gap_s", "children", "counting", "include_shmem", "processes",
     "max_rss_bytes", "sampler_priority", "cgroup_peak", "interrupted", "left_running"}

``exit_code`` is the command's own (128 + N when signal N ended it), and
``guard_exit_code`` is what ``hostmem guard`` exits with: the command's code, or
:data:`EXIT_OVER_LIMIT` when the peak exceeded the limit and the command succeeded,
or 128 + N when signal N interrupted the guard (``interrupted``; no verdict then).
``max_rss_bytes`` is the kernel's high-water mark of the command's resident memory
(file pages included, waited-for descendants too), a figure no sampling can miss.
``left_running`` lists the processes the command left behind in its memory cgroup;
they were moved out of it, not killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from contextlib import ExitStack
from typing import NamedTuple

from .errors import InputError
from .cgroup_sandbox import MemoryCgroup, can_nest_memory_cgroup, memory_cgroup
from .child_wait import DEFAULT_GRACE_S, HeldSignals
from .peak import DEFAULT_INTERVAL_S, CgroupPeak, PeakFigures, PeakTracker, PeakTrackerError
from .proctree import kill_tree, signal_tree
from .units import format_size

__all__ = ["EXIT_OVER_LIMIT", "COUNTING", "GuardResult", "run_guarded"]

EXIT_OVER_LIMIT = 3
COUNTING = ("auto", "cgroup", "tree")


class GuardResult(NamedTuple):
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
    cgroup: CgroupPeak | None = None
    counting: str = "one process"
    pid: int = 0
    interrupted: int | None = None
    reached: str = ""
    killed: int = 0
    grace_s: float = DEFAULT_GRACE_S
    left_running: tuple[int, ...] = ()

    @property
    def exceeded(self) -> bool:
        """True when the peak anonymous memory was above the limit."""
        return self.figures.peak_bytes > self.limit_bytes

    @property
    def guard_exit_code(self) -> int:
        """128 + N when signal N interrupted the guard; else the command's code,
        except that a successful command over the limit gets 3."""
        if self.interrupted is not None:
            return 128 + self.interrupted
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
            "counting": self.counting,
            "include_shmem": self.include_shmem,
            "processes": fig.processes,
            "max_rss_bytes": self.max_rss_bytes,
            "sampler_priority": fig.sampler_priority,
            "cgroup_peak": self.cgroup.to_dict() if self.cgroup else None,
            "interrupted": self.interrupted,
            "left_running": list(self.left_running),
        }

    def _counted(self) -> str:
        """E.g. "3 processes, memory cgroup": how many were counted, and how."""
        if self.counting == "one process":
            return "the command's own process only"
        n = self.figures.processes
        return f"{n} process{'' if n == 1 else 'es'}, {self.counting}"

    def _ended(self) -> str:
        return f"killed by signal {self.signal}" if self.signal else f"exited {self.exit_code}"

    def verdict(self) -> str:
        """One line for a CI log: over or within, the peak, the limit and the exit."""
        fig = self.figures
        what = "anonymous+shmem" if self.include_shmem else "anonymous"
        head = "OVER LIMIT" if self.exceeded else "within limit"
        relation = ">" if self.exceeded else "<="
        return (
            f"hostmem guard: {head}: peak {what} {format_size(fig.peak_bytes)} {relation} "
            f"{format_size(self.limit_bytes)} ({self._counted()}; baseline {format_size(fig.baseline_bytes)}, "
            f"peak at {fig.peak_t_s:.2f} s of {fig.duration_s:.2f} s, {fig.samples} samples, longest gap "
            f"{fig.max_gap_s * 1000:.1f} ms); command {self._ended()}{self._left_text()}; "
            f"guard exits {self.guard_exit_code}"
        )

    def _left_text(self) -> str:
        if not self.left_running:
            return ""
        pids = ", ".join(str(pid) for pid in self.left_running)
        return f"; kept running: pid {pids}, which it left behind (moved out of the guard's memory cgroup)"

    def interruption(self) -> str:
        """One line for an interrupted guard: what reached the command, what was cleaned."""
        name = signal.Signals(self.interrupted).name
        how = {
            "passed on": f"passed {name} on to it",
            "terminal": f"it got {name} from the terminal too",
            "ended": f"{name} came after it had ended",
            "grace": f"it had not ended {self.grace_s:g} s after {name}, so it and all it started were killed",
            "second signal": "a second signal came before it ended, so it and all it started were killed",
        }[self.reached]
        cleaned = "the sampler and the guard's memory cgroup" if self.counting == "memory cgroup" else "the sampler"
        return (
            f"hostmem guard: interrupted by {name}: the command (pid {self.pid}) "
            f"{'was ' if self.signal else ''}{self._ended()} ({how}); "
            f"peak anonymous so far {format_size(self.figures.peak_bytes)} of the {format_size(self.limit_bytes)} "
            f"limit ({self._counted()}), not judged; cleaned up: {cleaned}{self._left_text()}; "
            "run the guard again for a verdict"
        )


def run_guarded(
    command: list[str] | tuple[str, ...],
    limit_bytes: int,
    *,
    interval_s: float = DEFAULT_INTERVAL_S,
    children: bool = True,
    counting: str = "auto",
    include_shmem: bool = False,
    env: dict | None = None,
    cwd: str | None = None,
    grace_s: float = DEFAULT_GRACE_S,
) -> GuardResult:
    """Run ``command`` to its end while tracking its peak anonymous memory.

    ``children`` (default) counts every process the command starts; ``counting``
    says how: "auto" (a memory cgroup where the machine allows one, else a tree
    scan), "cgroup" (a memory cgroup or an error) or "tree". The command inherits
    stdin, stdout and stderr. SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2
    sent to this process reach the command (see :mod:`hostmem.child_wait`) and are reported in
    ``interrupted``; a command still running ``grace_s`` after such a signal is
    killed with all it started. The memory cgroup is removed however the run ends.
    """
    command = tuple(str(part) for part in command)
    if not command:
        raise InputError("no command given: put it after '--', e.g. hostmem guard --max-peak-anon 4GiB -- python x.py")
    if limit_bytes < 0:
        raise InputError(f"limit_bytes={limit_bytes}: a limit is never negative")
    if counting not in COUNTING:
        raise InputError(f"counting={counting!r}: one of {', '.join(COUNTING)}")
    with ExitStack() as stack:
        held = stack.enter_context(HeldSignals(grace_s))  # left last: the clean-up is not interrupted
        group = _group_for(stack, children, counting)
        stack.callback(_move_out, group)  # whatever fails below, the group can still be removed
        tracker = PeakTracker(
            interval_s=interval_s, children=children, include_shmem=include_shmem, reset_hwm=False, group=group
        ).prepare()
        stack.callback(tracker.stop)  # idempotent: ends the sampler however the run ends
        proc = _start(command, env=env, cwd=cwd, group=group, held=held)
        _track(tracker, proc, command, group)
        waited = held.wait(proc, lambda signum: _signal_all(proc, group, signum), lambda: _kill_all(proc, group))
        tracker.stop()
        if held.received is not None:  # what it started got the signal too: let it end before "kept running"
            _let_the_group_end(group, grace_s)
        left = _move_out(group)
    return GuardResult(
        command=command,
        limit_bytes=int(limit_bytes),
        exit_code=waited.exit_code,
        signal=waited.signal,
        figures=tracker.figures(),
        interval_s=tracker.interval_s,
        children=tracker.children,
        include_shmem=tracker.include_shmem,
        max_rss_bytes=waited.usage.ru_maxrss * 1024 if waited.usage is not None else None,
        cgroup=tracker.cgroup,
        counting=tracker.counting,
        pid=proc.pid,
        interrupted=held.received,
        reached=held.reached,
        killed=held.killed,
        grace_s=grace_s,
        left_running=tuple(left),
    )


def _group_for(stack: ExitStack, children: bool, counting: str) -> MemoryCgroup | None:
    """A fresh memory cgroup for the command (removed when ``stack`` closes), or None."""
    if not children or counting == "tree":
        return None
    reason = can_nest_memory_cgroup()
    if reason is None:
        name = f"hostmem-guard-{os.getpid()}-{time.monotonic_ns()}"
        try:
            return stack.enter_context(memory_cgroup(None, name=name))
        except OSError as exc:
            reason = str(exc)
    if counting == "cgroup":
        raise InputError(f"cannot count the command in a memory cgroup of its own: {reason}")
    return None


def _start(command: tuple[str, ...], env: dict | None, cwd: str | None, group: MemoryCgroup | None, held):
    """Start the command (inside ``group`` before it runs); a missing program is named."""

    def prepare_child() -> None:  # in the child, between fork and exec
        held.unblock_in_child()
        if group is not None:
            group.join()

    try:
        return subprocess.Popen(list(command), env=env, cwd=cwd, preexec_fn=prepare_child)
    except FileNotFoundError:
        raise InputError(f"{command[0]}: command not found (check the name and PATH)") from None
    except PermissionError:
        raise InputError(f"{command[0]}: permission denied (is it executable?)") from None
    except NotADirectoryError:
        raise InputError(f"{cwd}: not a folder (the working folder for the command)") from None
    except subprocess.SubprocessError:  # joining the group failed in the child, before exec
        raise PeakTrackerError(
            f"could not start {command[0]} in the memory cgroup {group.path}: run with --no-children, "
            "or as a user that may write there"
        ) from None


def _track(tracker: PeakTracker, proc: subprocess.Popen, command: tuple[str, ...], group=None) -> None:
    """Start tracking the command just started; if that fails, end the command first.

    A command the guard cannot track must not run on unguarded (it could eat the
    host's memory with nobody judging it), so it is killed with every descendant it
    has started and reaped before the error is raised.
    """
    try:
        tracker.start(proc.pid)
    except BaseException as exc:
        _kill_all(proc, group)
        proc.wait()
        if isinstance(exc, PeakTrackerError):
            raise PeakTrackerError(
                f"could not track {command[0]} (pid {proc.pid}), so it was killed before it ran unguarded: "
                f"{exc}. Run the guard again; if this repeats, check that this user may read /proc/{proc.pid} "
                "and that the machine has memory to spare for the sampler"
            ) from exc
        raise


def _signal_all(proc: subprocess.Popen, group: MemoryCgroup | None, signum: int) -> int:
    """Send ``signum`` to every process of the command: its group, else its tree."""
    return group.signal_all(signum) if group is not None else signal_tree(proc.pid, signum)


def _kill_all(proc: subprocess.Popen, group: MemoryCgroup | None) -> int:
    """SIGKILL the command and all it started: its tree, and everything in its group."""
    killed = kill_tree(proc.pid)
    if group is not None:
        killed += group.kill_all()
    return killed


def _let_the_group_end(group: MemoryCgroup | None, grace_s: float) -> None:
    """Wait up to ``grace_s`` for every process left in ``group`` to end (after a signal
    passed on to all of them, the command may end before what it started)."""
    deadline = time.monotonic() + grace_s
    while group is not None and group.pids() and time.monotonic() < deadline:
        time.sleep(0.02)


def _move_out(group: MemoryCgroup | None) -> list[int]:
    """Move what the command left running out of its group, so that the group can go."""
    if group is None:
        return []
    left: list[int] = []
    for _ in range(10):  # a process may fork while it is moved: look again
        moved = group.move_out()
        if not moved:
            break
        left.extend(pid for pid in moved if pid not in left)
    return left
