"""One pass of a component at a time on the device path, whatever thread runs it.

A layer's device copy is attached to its module, which two passes of the component from
two threads would both use, so a pass takes the component's turn in its forward pre-hook
and gives it back when the forward ends (a forward hook, and the forward's wrapper for an
interrupt, :mod:`.forward_guard`). An interrupt no wrapper sees (in a pre-hook after the
turn was taken, or in the first call after another library set the forward back to one
without the wrapper) would keep the turn for good; so a caller that finds the turn held
by a thread with no call of the component under way (:func:`hostmem.forward_exit.forward_calls`)
takes it back, and so does the holder's own thread at its next pass, and says the pass
it took it from was left (its clean-up is the caller's).
"""

from __future__ import annotations

import threading

from torch import nn

from hostmem.forward_exit import LOOK_S, forward_calls

__all__ = ["Turn"]

class Turn:
    """A component's turn: re-entrant for the thread that holds it."""

    def __init__(self, root: nn.Module):
        self.root = root
        self._cond = threading.Condition()
        self._owner: int | None = None
        self._depth = 0
        self._outside = False  # held outside any call of the component (the executor's exit): never taken back

    def take(self, outside: bool = False) -> bool:
        """Wait for the turn and take it (from the component's forward pre-hook; ``outside``: by
        a thread in no call of it, the executor's exit, which a waiter must not take it back
        from); True when a pass an interrupt left held it, and it was taken back."""
        me = threading.get_ident()
        left = False
        with self._cond:
            if self._owner == me and not outside:
                calls = forward_calls(me, self.root)  # this call among them
                if calls is not None and self._depth > calls - 1:  # holds of calls no longer under way
                    self._depth = max(0, calls - 1)
                    left = self._depth == 0
            elif self._owner != me:
                while self._owner is not None:
                    if not self._cond.wait(LOOK_S) and self._owner is not None and not self._outside \
                            and forward_calls(self._owner, self.root) == 0:
                        self._owner, self._depth, left = None, 0, True
            self._owner = me
            self._depth += 1
            self._outside = self._outside or outside
        return left

    def give_back(self) -> None:
        """The pass ends; a thread that holds no turn (its pre-hook failed before taking it) gives nothing back."""
        with self._cond:
            if self._owner != threading.get_ident():
                return
            self._depth -= 1
            if self._depth == 0:
                self._owner, self._outside = None, False
                self._cond.notify_all()
