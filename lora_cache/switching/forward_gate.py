"""Safe points: a swap of a model's weights never overlaps one of its forward calls.

Forward calls enter the gate shared (any number at once, from any threads); a swap
enters it exclusively, after every forward in flight has left and before the next one
enters. A forward therefore sees the model wholly before or wholly after a swap, never
half-swapped. The hooks that enter and leave live on the model's root modules
(``always_call``, so a forward that raises still leaves; a wrapper of the forward, so an
interrupt does too: :mod:`hostmem.forward_exit`). Where an interrupt leaves a forward
unseen by either (in a pre-hook, or in the first call after another library set the
forward back), the place it held is given back once its thread has no call of the
model's roots under way (:func:`hostmem.forward_exit.forward_calls`): a swap waiting for
it looks every half second, and the thread itself at its next switch.
"""

from __future__ import annotations

import contextlib
import threading

from hostmem.errors import HostmemError
from hostmem.forward_exit import LOOK_S, forward_calls

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
        self.roots: tuple = ()  # the modules whose forwards enter it (set where they are hooked)

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
        me = threading.get_ident()
        with self._cond:
            self._give_back_left(me)
            return me in self._readers

    def _give_back_left(self, thread: int) -> None:
        """Count ``thread`` inside only as many forwards as it has calls of the roots under way
        (the others were left by an interrupt nothing saw); unchanged where that cannot be told."""
        if not self.roots or thread not in self._readers:
            return
        calls = [forward_calls(thread, root) for root in self.roots]
        if None in calls or sum(calls) >= self._readers[thread]:
            return
        if sum(calls):
            self._readers[thread] = sum(calls)
        else:
            self._readers.pop(thread)
        self._cond.notify_all()

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
                        if not self._cond.wait(LOOK_S):  # a reader left by an interrupt is given back
                            for thread in list(self._readers):
                                self._give_back_left(thread)
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
