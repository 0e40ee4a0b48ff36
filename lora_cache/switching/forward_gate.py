"""Safe points: a swap of a model's weights never overlaps one of its forward calls.

Forward calls enter the gate shared (any number at once, from any threads); a swap
enters it exclusively, after every forward in flight has left and before the next one
enters. A forward therefore sees the model wholly before or wholly after a swap, never
half-swapped. The hooks that enter and leave live on the model's root modules
(``always_call``, so a forward that raises still leaves).
"""

from __future__ import annotations

import contextlib
import threading

from hostmem.errors import HostmemError

__all__ = ["ForwardGate", "NotASafePoint"]


class NotASafePoint(HostmemError, RuntimeError):
    """A swap was asked for from inside a forward call of the same model."""


class ForwardGate:
    """A shared/exclusive gate in which forwards never wait for each other, and a swap
    waits only for the forwards already running (new ones wait for it)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers: dict[int, int] = {}  # thread id -> depth of forward calls in it
        self._writing = False
        self._waiting = 0  # swaps waiting: new forwards hold back for them, so a busy model still swaps

    def enter(self) -> None:
        """A forward call begins: wait while a swap is under way."""
        me = threading.get_ident()
        with self._cond:
            while (self._writing or self._waiting) and me not in self._readers:
                self._cond.wait()
            self._readers[me] = self._readers.get(me, 0) + 1

    def leave(self) -> None:
        """A forward call ended (also by an exception)."""
        me = threading.get_ident()
        with self._cond:
            depth = self._readers.get(me, 0) - 1
            if depth > 0:
                self._readers[me] = depth
            else:
                self._readers.pop(me, None)
            self._cond.notify_all()

    @property
    def in_forward(self) -> bool:
        """True when the calling thread is inside a forward call of the model."""
        with self._cond:
            return threading.get_ident() in self._readers

    def refuse_inside(self) -> None:
        """Raise :class:`NotASafePoint` when called from inside a forward of the model."""
        if self.in_forward:
            raise NotASafePoint(
                "adapters cannot be switched from inside a forward call of the same model; "
                "switch between forward calls"
            )

    @contextlib.contextmanager
    def exclusive(self, blocking: bool = True):
        """Hold the model still: wait for the forwards in flight, keep new ones out.

        Yields False without holding anything when ``blocking`` is False and a forward
        (or another swap) is under way. Raises :class:`NotASafePoint` when called from
        inside a forward of the same model, which would wait for itself.
        """
        self.refuse_inside()
        acquired = False
        with self._cond:
            if blocking or not (self._writing or self._readers):
                self._waiting += 1
                try:
                    while self._writing or self._readers:
                        self._cond.wait()
                finally:
                    self._waiting -= 1
                self._writing = acquired = True
        if not acquired:
            yield False
            return
        try:
            yield True
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()
