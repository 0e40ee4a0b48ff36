"""SIGINT and SIGTERM stop a command that writes as Ctrl-C does (``KeyboardInterrupt``), so
that it removes or seals what it wrote and says so in one line, exit 130; a second
signal while it does is ignored."""

from __future__ import annotations

import contextlib
import signal

__all__ = ["stoppable"]


def _interrupt(signum, frame) -> None:
    """Turn the first SIGINT/SIGTERM into KeyboardInterrupt; ignore later ones while the
    build seals what it has (a second signal must not tear what the first stops)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextlib.contextmanager
def stoppable():
    """SIGINT and SIGTERM stop the build as KeyboardInterrupt; the old handlers come back after."""
    old = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
