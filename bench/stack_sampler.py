"""Where a process's threads spend a stretch of time, from their Python stacks.

A thread of its own reads every other thread's stack (``sys._current_frames``) each
millisecond and charges the time since its last look to what each thread was doing:
its innermost frame and the nearest two frames of this project's code above it. The
main thread's samples also make a timeline of its phases (runs of one project frame).
Time in C code that releases the GIL (torch, the disk) is charged to the Python line
that called it; the sampler needs the GIL itself, so it slows threads that want it
(a profiled run's times are not the bench's figures).

    with StackSampler() as sampler:
        lora_cache.merge(...)
    print(sampler.report("the rank alone"))
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time

__all__ = ["StackSampler"]

_PROJECT = (f"{os.sep}hostmem{os.sep}", f"{os.sep}lora_cache{os.sep}", f"{os.sep}planners{os.sep}")


def _where(frame) -> tuple[str, list[str]]:
    """The innermost frame (file:function:line) and the nearest three project frames,
    the innermost first where it is one."""
    inner = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}:{frame.f_lineno}"
    ours = []
    while frame is not None and len(ours) < 3:
        if any(part in frame.f_code.co_filename for part in _PROJECT):
            ours.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return inner, ours


def _kind(name: str) -> str:
    """A pool's thread name without its number: ``lora-cache-sum_3`` is ``lora-cache-sum``."""
    return name.split("_")[0].rstrip("-0123456789") or name


class StackSampler:
    """Samples every thread but its own each ``period`` seconds while in its ``with`` block."""

    def __init__(self, period: float = 0.001):
        self.period = period
        self.seconds: collections.Counter = collections.Counter()  # (thread kind, where) -> seconds
        self.phases: list[list] = []  # the main thread's [project frame, start, end], seconds from the start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def __enter__(self) -> StackSampler:
        self._start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me, main = threading.get_ident(), threading.main_thread().ident
        last = time.perf_counter()
        while not self._stop.wait(self.period):
            now = time.perf_counter()
            spent, last = now - last, now
            names = {t.ident: _kind(t.name) for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                inner, ours = _where(frame)
                self.seconds[(names.get(ident, "?"), " <- ".join([inner] + [f for f in ours if f != inner][:2]))] += spent
                if ident == main:
                    self._extend((ours[0] if ours else inner).rsplit(":", 1)[0], now - self._start, spent)

    def _extend(self, phase: str, at: float, spent: float) -> None:
        if self.phases and self.phases[-1][0] == phase:
            self.phases[-1][2] = at
        else:
            self.phases.append([phase, at - spent, at])

    def report(self, label: str, top: int = 20, shortest_phase: float = 0.008) -> str:
        """The main thread's phases of at least ``shortest_phase`` seconds, each thread kind's
        seconds, and the ``top`` (thread kind, where) by seconds."""
        lines = [f"{label}: the main thread's phases of {shortest_phase * 1e3:.0f} ms or more"]
        lines += [f"  {start:6.3f}-{end:6.3f} s  {name}" for name, start, end in self.phases
                  if end - start >= shortest_phase]
        kinds: collections.Counter = collections.Counter()
        for (kind, _), seconds in self.seconds.items():
            kinds[kind] += seconds
        lines.append(f"{label}: thread-seconds by thread: " + ", ".join(f"{k} {s:.2f}" for k, s in kinds.most_common()))
        lines += [f"  {seconds:6.3f} s  {kind:<20} {where}" for (kind, where), seconds in self.seconds.most_common(top)]
        return "\n".join(lines)
