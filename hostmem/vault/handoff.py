"""One buffer's bytes passed from the merge to the vault's writer as they are computed.

A layer's merged bytes are computed in row blocks, in order, into one reused output
buffer. A :class:`Handoff` lets the vault write each finished stretch while the rest
of the layer is still being summed, and lets the next layer's sum reuse each stretch
of the buffer as soon as it is on disk. So the disk and the arithmetic overlap inside
a layer and across layers with a single one-layer buffer, and the build touches half
the fresh memory two whole-layer buffers would (on a virtual machine a fresh page can
cost more to touch than to write: about 2.8 ms per MiB on a 2-core one).

Two sides, each advancing one count of bytes from the start of the buffer:

- the producer (the merge) :meth:`publish`\\ es how many bytes are final, and
  :meth:`cancel`\\ s when it fails;
- the consumer (the writer) waits for them with :meth:`wait_ready`,
  :meth:`release`\\ s what it has written (the producer of the next layer waits for
  that with :meth:`wait_released`), and releases everything when it ends, however it
  ends, so a producer never waits on a writer that gave up.
"""

from __future__ import annotations

import threading

from ..errors import HostmemError

__all__ = ["Handoff", "HandoffCancelled"]


class HandoffCancelled(HostmemError, RuntimeError):
    """The producer failed: the bytes the consumer waits for will never come."""


class Handoff:
    """The bytes ``[0, nbytes)`` of one buffer, handed over in order (thread-safe)."""

    def __init__(self, nbytes: int):
        self.nbytes = int(nbytes)
        self._ready = 0
        self._released = 0
        self._cancelled = False
        # Two conditions over one lock, so that each side wakes only the other, and only
        # when it can go on: a publish per row block would otherwise wake the writer (and
        # any waiting summing thread) every time, on cores the sum needs.
        lock = threading.Lock()
        self._ready_changed = threading.Condition(lock)
        self._released_changed = threading.Condition(lock)
        self._wanted = 0  # what the waiting consumer waits for

    # ----------------------------------------------------------------- producer

    def publish(self, end: int) -> None:
        """Bytes ``[0, end)`` are final (a smaller ``end`` than before changes nothing)."""
        with self._ready_changed:
            if end > self._ready:
                self._ready = min(int(end), self.nbytes)
                if self._ready >= self._wanted:
                    self._ready_changed.notify_all()

    def cancel(self) -> None:
        """The rest will never be published: a waiting consumer raises :class:`HandoffCancelled`."""
        with self._ready_changed:
            self._cancelled = True
            self._ready_changed.notify_all()

    def wait_released(self, end: int) -> None:
        """Block until the consumer is done with bytes ``[0, end)`` (they may be overwritten)."""
        with self._released_changed:
            self._released_changed.wait_for(lambda: self._released >= min(end, self.nbytes))

    # ----------------------------------------------------------------- consumer

    def wait_ready(self, start: int, at_least: int) -> int:
        """Block until at least ``at_least`` bytes past ``start`` are final (or all of them
        are); return how many bytes from the buffer's start are final."""
        goal = min(start + at_least, self.nbytes)
        with self._ready_changed:
            self._wanted = goal
            self._ready_changed.wait_for(lambda: self._ready >= goal or self._cancelled)
            if self._ready < goal:
                raise HandoffCancelled(f"the merge stopped after {self._ready} of {self.nbytes} bytes")
            return self._ready

    def release(self, end: int | None = None) -> None:
        """The consumer is done with bytes ``[0, end)``; with no ``end``, with all of them."""
        with self._released_changed:
            end = self.nbytes if end is None else min(int(end), self.nbytes)
            if end > self._released:
                self._released = end
                self._released_changed.notify_all()
