"""Ctrl-C in a few steps that must not be cut in two comes after them: real signals, sent
to this process while the steps run, reach their handlers once the steps are done."""

from __future__ import annotations

import os
import signal

import pytest

from hostmem.vault.deferred import interrupts_deferred


def test_every_signal_that_came_reaches_its_handler_after_the_block_and_the_handlers_are_put_back():
    seen = []

    def count(signum, frame):
        seen.append(signum)
        if len(seen) == 1:
            raise KeyboardInterrupt("the first")

    before = {sig: signal.signal(sig, count) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(KeyboardInterrupt, match="the first"):
            with interrupts_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(1000):  # the handlers run between bytecodes: here they only note the signal
                    pass
                assert seen == []
        assert seen == [signal.SIGINT, signal.SIGTERM]  # a second signal counts, as it would have
        assert signal.getsignal(signal.SIGINT) is count and signal.getsignal(signal.SIGTERM) is count
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
