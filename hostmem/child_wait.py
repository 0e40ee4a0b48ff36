"""Wait for a command to end while passing the signals meant for it on.

``hostmem guard`` stands between a person (or a CI runner) and the command it runs.
A SIGINT, SIGTERM, SIGHUP or SIGQUIT (Ctrl-\\), or a SIGUSR1 or SIGUSR2, sent to the
guard is meant for the command (left to their default action, each would end the guard
and leave its command running, its memory cgroup behind): the guard
passes it on to every process of the command (as a terminal sends Ctrl-C to every
process of its foreground group, so that a script's children end too), waits for
the command to end, and then reports the interruption instead of a verdict. A
Ctrl-C at a terminal has already reached the command (the kernel sends it to the
whole foreground process group), and a second SIGINT could cut the command's own
clean-up short, so such a signal is not sent again. Only the
signal's origin tells the two apart (``si_code`` SI_KERNEL for the terminal's,
SI_USER for kill(2)), and only ``sigtimedwait`` reveals it: so while the command
runs, these signals are blocked and waited for instead of handled.

When the command has not ended ``grace_s`` after the first signal, or a second
signal comes, ``kill`` ends everything it started: an interrupted guard never
leaves its command running, and never hangs on one that ignores the signal.

A signal the guard was started with ignored (``nohup`` ignores SIGHUP, a shell's
background job SIGINT and SIGQUIT) stays ignored: its command inherits it ignored, so
passing it on would only end in the kill after ``grace_s``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import Callable, NamedTuple

__all__ = ["Waited", "HeldSignals", "PASSED_ON", "DEFAULT_GRACE_S"]

SI_KERNEL = 0x80  # si_code of a signal the kernel sent itself, e.g. a terminal's Ctrl-C
PASSED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
DEFAULT_GRACE_S = 10.0
_POLL_S = 1.0  # a safety net only: the command's end wakes the wait at once (SIGCHLD)


class Waited(NamedTuple):
    """How the command ended, and what interrupted the guard meanwhile.

    ``exit_code`` is the command's (128 + N when signal N ended it); ``usage`` its
    rusage from wait4, or None where it was reaped elsewhere.
    """

    exit_code: int
    signal: int | None
    usage: object | None


class HeldSignals:
    """Hold the signals of :data:`PASSED_ON` back from this process while a command runs.

    Use as a context manager around the whole run: the start (a signal that comes
    while the command is starting is passed on once it runs; the command itself
    starts unblocked, see :meth:`unblock_in_child`), :meth:`wait` and the clean-up
    after it, so that an interrupt never lands half-way through either. Outside the main thread
    nothing is held (signals only reach the main thread's handlers) and the wait is
    plain. ``received`` is the first signal held back, or None; ``reached`` says how
    it reached the command: "passed on" (sent on by the guard), "terminal" (the
    terminal sent it to the command too) or "ended" (it came after the command had
    ended), then "grace" or "second signal" when ``kill`` ended the command after
    the grace period or a second signal; ``killed`` counts the processes it ended.
    """

    def __init__(self, grace_s: float = DEFAULT_GRACE_S):
        self.grace_s = grace_s
        self.received: int | None = None
        self.reached = ""
        self.killed = 0
        self._saved_mask: set | None = None
        ignored = {sig for sig in PASSED_ON if signal.getsignal(sig) is signal.SIG_IGN}  # nohup's, a background job's
        self._watched = {*PASSED_ON, signal.SIGCHLD} - ignored

    def __enter__(self) -> "HeldSignals":
        if threading.current_thread() is threading.main_thread():
            self._saved_mask = signal.pthread_sigmask(signal.SIG_BLOCK, self._watched)
        return self

    def __exit__(self, *exc) -> None:
        if self._saved_mask is None:
            return
        while True:  # what came during the clean-up is recorded here, not raised later
            info = signal.sigtimedwait(self._watched, 0)
            if info is None:
                break
            if info.si_signo != signal.SIGCHLD and self.received is None:
                self.received, self.reached = info.si_signo, "ended"
        signal.pthread_sigmask(signal.SIG_SETMASK, self._saved_mask)
        self._saved_mask = None

    def unblock_in_child(self) -> None:
        """Give a child started while signals are held the mask it would have had.

        Call it first in a ``preexec_fn``: a forked child inherits the signal mask
        across exec, and a command with SIGINT blocked could not be interrupted.
        """
        if self._saved_mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self._saved_mask)

    def wait(self, proc: subprocess.Popen, pass_on: Callable[[int], int], kill: Callable[[], int]) -> Waited:
        """Reap ``proc``; ``pass_on(signum)`` signals all of the command, ``kill()`` ends it all."""
        deadline = None
        while True:
            done = _reap(proc, os.WNOHANG if self._saved_mask is not None else 0)
            if done is not None:
                return done
            timeout = _POLL_S if deadline is None else max(0.0, min(_POLL_S, deadline - time.monotonic()))
            info = signal.sigtimedwait(self._watched, timeout)
            if info is not None and info.si_signo != signal.SIGCHLD:
                if self.received is None:
                    self.received = info.si_signo
                    self._pass_on(proc, info, pass_on)
                    deadline = time.monotonic() + self.grace_s
                    continue
                deadline, self.reached = time.monotonic(), "second signal"  # do not wait any longer
            if deadline is not None and time.monotonic() >= deadline and not self.killed:
                self.reached = "second signal" if self.reached == "second signal" else "grace"
                self.killed = max(1, kill())

    def _pass_on(self, proc: subprocess.Popen, info, pass_on: Callable[[int], int]) -> None:
        """Send the signal to the command, unless the terminal already sent it there."""
        try:
            from_terminal = info.si_code == SI_KERNEL and os.getpgid(proc.pid) == os.getpgrp()
        except ProcessLookupError:
            self.reached = "ended"  # the next reap sees it
            return
        if from_terminal:
            self.reached = "terminal"
        else:
            self.reached = "passed on" if pass_on(info.si_signo) > 0 else "ended"


def _reap(proc: subprocess.Popen, flags: int) -> Waited | None:
    """wait4 the command (its rusage comes with it); None while it still runs."""
    try:
        pid, status, usage = os.wait4(proc.pid, flags)
    except ChildProcessError:  # reaped elsewhere (SIGCHLD ignored): no rusage
        code = proc.wait()
        return Waited(128 - code, -code, None) if code < 0 else Waited(code, None, None)
    if pid == 0:
        return None
    proc.returncode = os.waitstatus_to_exitcode(status)
    if os.WIFSIGNALED(status):
        return Waited(128 + os.WTERMSIG(status), os.WTERMSIG(status), usage)
    return Waited(os.WEXITSTATUS(status), None, usage)
