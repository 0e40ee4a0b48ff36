"""SIGINT and SIGTERM stop a command that writes as Ctrl-C does (``KeyboardInterrupt``), so
that it removes or seals what it wrote and says so in one line, exit 130.

Three moments need care:

- while the command imports torch and its kind, a ``KeyboardInterrupt`` raised in a
  signal handler lands inside their initialisation: torch swallows it (its NumPy set-up)
  or a C++ frame aborts on it. So a command enters :func:`stoppable` unarmed and
  arms it (:meth:`Stop.arm`) once those are done: a signal before then is held, and raised there;
- a second signal while the first's clean-up runs must not tear it, and must not be
  lost either: it ends the process at once, as its default action would, after one line
  (the cache survives a kill; what was sealed stays);
- once the command is done, a signal ends nothing it could lose: it is ignored until the
  process exits (:func:`quiet_exit`).
"""

from __future__ import annotations

import contextlib
import os
import signal

__all__ = ["Stop", "quiet_exit", "stoppable"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stop:
    """The signals of one stoppable command: the first is raised as ``KeyboardInterrupt``
    once armed (held until then), a later one ends the process."""

    def __init__(self, armed: bool):
        self.armed = armed
        self.seen: str | None = None

    def handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.seen is not None:  # a second one: the clean-up of the first is not waited for
            with contextlib.suppress(OSError):
                os.write(2, f"hostmem: {name} again: stopping at once; what was sealed stays\n".encode())
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.seen = name
        if self.armed:
            raise KeyboardInterrupt(name)

    def arm(self) -> None:
        """From here on a signal stops the command at once; one held until now stops it here."""
        self.armed = True
        if self.seen is not None:
            raise KeyboardInterrupt(self.seen)


@contextlib.contextmanager
def stoppable(armed: bool = True):
    """SIGINT and SIGTERM stop the command as KeyboardInterrupt (see :class:`Stop`); yields
    the :class:`Stop`; the old handlers come back after. ``armed=False``: held until
    :meth:`Stop.arm`."""
    stop = Stop(armed)
    old = {sig: signal.signal(sig, stop.handle) for sig in _SIGNALS}
    try:
        yield stop
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def quiet_exit() -> None:
    """The command is done and the process about to exit (its teardown takes torch a few
    tenths of a second): a SIGINT or SIGTERM now is ignored, not turned into a kill that
    reports a finished command as killed."""
    for sig in _SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
