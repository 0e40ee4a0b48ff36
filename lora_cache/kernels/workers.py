"""The threads a layer's row blocks are summed on."""

from __future__ import annotations

import contextlib
import contextvars
import os
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["BlockWorkers", "block_workers", "cpu_count", "workers_at_most"]

MAX_WORKERS = 8  # the sum then outruns any disk
_AT_MOST: contextvars.ContextVar[int | None] = contextvars.ContextVar("lora_cache_workers_at_most", default=None)


def cpu_count() -> int:
    """The CPUs this process may run on (its affinity mask, where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _single_threaded() -> None:
    """Make this thread's own torch operations single-threaded.

    ``torch.set_num_threads`` sets OpenMP's thread count of the calling thread only, and
    a new thread starts with OpenMP's default (every core): the bf16 product (oneDNN's
    matmul) then starts a team of its own on each call, whose threads spin between
    calls. Left so, a worker summing 512 small layers kept a second core spinning for a
    third of the build, beside the writer and sealers that needed it.
    """
    torch.set_num_threads(1)


class BlockWorkers(ThreadPoolExecutor):
    """A thread pool that says how many blocks it runs at once (``threads``), so the
    merge sizes one fp32 accumulator per block in flight; each of its threads runs
    torch single-threaded."""

    def __init__(self, threads: int):
        super().__init__(threads, "lora-cache-sum", initializer=_single_threaded)
        self.threads = threads


def worker_count() -> int:
    """How many block workers a CPU merge runs: one per CPU, at most :data:`MAX_WORKERS`."""
    return min(MAX_WORKERS, cpu_count())


@contextlib.contextmanager
def workers_at_most(threads: int):
    """Within (this thread's context), :func:`block_workers` start at most ``threads`` workers.

    For a process that shares the host's cores with others building at the same time
    (the local ranks of a shared build, :mod:`lora_cache.ranks.shared_build`): each starting a
    worker per core would put ranks x cores summing threads on the cores. The kernel
    choice is not affected (:func:`worker_count` still names the machine's count).
    """
    token = _AT_MOST.set(max(1, int(threads)))
    try:
        yield
    finally:
        _AT_MOST.reset(token)


@contextlib.contextmanager
def block_workers(device: torch.device):
    """Threads that sum a layer's row blocks on the CPU, while the vault writes the last one.

    Each worker runs torch single-threaded and takes the next block when it is done, so
    the writer thread (and the vault's checksum) just share the cores with them: one
    descheduled worker delays one block, where an OpenMP pool spread over every core
    would stall at each operation's barrier. The workers run at the process's own
    priority: a server waits for this build, and with the workers made nicer any other
    load on the host (another rank loading, the text encoder, a neighbour) took their
    cores. On a GPU the sum takes no CPU to speak of, so there are no workers. The
    process-wide torch thread count is restored when the build ends, also on an error;
    the workers end with it.
    """
    if device.type != "cpu":
        yield None
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with BlockWorkers(min(worker_count(), _AT_MOST.get() or MAX_WORKERS)) as workers:
            yield workers
    finally:
        torch.set_num_threads(threads)
