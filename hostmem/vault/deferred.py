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
    try:
        for sig in _SIGNALS:
            handler = signal.getsignal(sig)
            if callable(handler):
                signal.signal(sig, lambda signum, frame: came.append((signum, frame)))
                old[sig] = handler
        yield
    finally:
        for sig, handler in old.items():  # a signal between two of these is one that came
            signal.signal(sig, handler)
        _deliver(came, old)


def _deliver(came: list, handlers: dict) -> None:
    """Hand each signal that came to its handler, in order; the first exception one raises
    (KeyboardInterrupt) is raised once all have had theirs (a second Ctrl-C still counts)."""
    first = None
    for signum, frame in came:
        try:
            handlers[signum](signum, frame)
        except BaseException as exc:  # noqa: BLE001 (raised below, after the others)
            first = first or exc
    if first is not None:
        raise first
