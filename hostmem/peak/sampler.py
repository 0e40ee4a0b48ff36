"""The tracker's side of the sampler process: start it, talk to it, end it.

The sampler is :mod:`hostmem.peak.sampler_program`, run as a script by a separate
interpreter so that it samples while the tracked process holds its GIL. This module
speaks its line protocol (``begin PID``, ``snap``, ``stop``; one JSON report back per
command) and turns every way it can fail into a :class:`PeakTrackerError` that says
what happened.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

from ..procfs import ProcReadError

__all__ = ["PeakTrackerError", "SamplerProcess", "SAMPLER_PROGRAM"]

SAMPLER_PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sampler_program.py")
REPLY_TIMEOUT_S = 30.0  # generous: a loaded CI machine may starve the sampler for seconds
_RESCAN_MIN_S = 0.005  # descendants are looked for at most every 5 ms: a /proc walk costs ~1 ms


class PeakTrackerError(ProcReadError):
    """The sampler could not start, could not read the process, or stopped answering."""


class SamplerProcess:
    """One sampler interpreter, started at once and pointed at a process by ``begin``."""

    def __init__(self, interval_s: float, children: bool, include_shmem: bool, points: int, group=None):
        """``group``: a memory cgroup (``.path``, ``.version``) whose own figure is sampled."""
        args = [
            f"interval={interval_s!r}",
            f"shmem={int(include_shmem)}",
            f"children={int(children)}",
            f"points={int(points)}",
            f"rescan={max(interval_s, _RESCAN_MIN_S)!r}",
        ]
        if group is not None:
            args += [f"cgroup={group.path}", f"cgver={group.version}"]
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", SAMPLER_PROGRAM, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self._pending = b""

    @property
    def pid(self) -> int:
        return self.proc.pid

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
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.close()
                raise PeakTrackerError(
                    f"peak sampler (pid {self.proc.pid}) gave no answer within {REPLY_TIMEOUT_S:.0f} s and was "
                    "stopped; the machine may be overloaded: run fewer jobs at once"
                )
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise PeakTrackerError(f"peak sampler (pid {self.proc.pid}) exited without an answer: {self._stderr()}")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line

    def _stderr(self) -> str:
        """The sampler's last line of stderr, or how it ended (e.g. killed by a signal)."""
        try:
            self.proc.wait(timeout=5)
            text = self.proc.stderr.read().decode(errors="replace").strip()
        except (subprocess.TimeoutExpired, ValueError, OSError):
            text = ""
        if text:
            return text.splitlines()[-1]
        code = self.proc.returncode
        if code is not None and code < 0:
            return f"killed by signal {-code} (the out-of-memory killer, or another process, ended it)"
        return f"exit status {code}"

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
