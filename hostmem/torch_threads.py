"""Small tensor work on one thread.

torch's intra-op thread pool stalls at every operation's barrier when the cores are busy:
measured with load 7 on 2 cores, 2 MiB compared in 30 ms on 2 threads against 1.4 ms on
one, and a rounding measure of 56 layers (blocks of a few KiB) in 0.5 s against 7 ms. A
pass that is memory-bound, or whose blocks are small, gains nothing from more threads.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["one_thread"]


@contextlib.contextmanager
def one_thread():
    """Run the block (or the decorated function) with torch on one thread, then restore
    the number of threads it had."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
