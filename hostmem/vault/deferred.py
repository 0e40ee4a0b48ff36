"""A few steps that must not be cut in two by Ctrl-C: the signal comes after them.

A ``KeyboardInterrupt`` (or a command's own SIGTERM handler, :mod:`planners.commands.stopping`)
is raised between any two bytecodes of the main thread. Where a sequence of file system
steps leaves the store in a state the next start cannot take up when it stops half-way
(a finished build's re-key: its manifest names the real key, its folder still the
provisional one), the signal waits for the sequence's end instead: its handler is
called then, as it would have been.
"""

from __future__ import annotations

import contextlib
import signal
import threading

__all__ = ["interrupts_deferred"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def interrupts_deferred():
    """Run the block to its end: a SIGINT or SIGTERM whose handler is a Python one that
    comes meanwhile is handed to that handler once the block is done (signals reach
    Python's handlers in the main thread only; elsewhere this does nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list = []
    old = {}
    for sig in _SIGNALS:
        handler = signal.getsignal(sig)
        if callable(handler):
            old[sig] = handler
            signal.signal(sig, lambda signum, frame: came.append((signum, frame)))
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if came:
            signum, frame = came[0]
            old[signum](signum, frame)  # raises, as it would have where the signal came
