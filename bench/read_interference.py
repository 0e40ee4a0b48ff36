"""What reading on one core costs a compute on the other: the executor's pass, taken apart.

The executor's pass computes on one thread while its readers bring the next layers in on
the other core. On a 2-core virtual machine the pass's own thread ran 0.20-0.21 s of CPU
a pass under the executor against 0.15-0.16 s with the model in page cache (the same
matmuls): the compute itself runs slower while the reads go on. This probe asks which
part of a read costs it. A compute pinned to the first core, one thread, runs alone and
then beside a reader pinned to the second core, which reads a scratch file of ``--size``
over and over, one way at a time:

- ``direct``: ``O_DIRECT`` preads in another process: the disk (the host, on a virtual
  machine) writes into one buffer; this machine's page cache is not touched;
- ``buffered``: preads through the page cache in another process, the file dropped
  after each time round: pages allocated, filled, freed;
- ``mapped, other process``: a read-only mapping advised ``MADV_HUGEPAGE``, one touch a
  page, then unmapped and dropped: the executor's reader, in a process of its own;
- ``mapped, this process``: the same on a thread of the computing process, as the
  executor runs it: its page tables are the compute's.

Two computes: ``alu``, a 256x256 float matmul over and over (in cache: what slows it is
the core, not the memory), and ``gemv``, a bf16 matrix-vector product over 1 GiB of
weights in anonymous memory (what a pass does). Rounds alternate the order of the ways;
figures are medians, each against the compute alone in the same round.

    .venv/bin/python bench/read_interference.py            # 1 GiB file
    .venv/bin/python bench/read_interference.py --quick    # 64 MiB file
"""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing as mp
import os
import statistics
import threading
import time

import torch

from common import bench_args, format_size, report, workdir  # noqa: E402

ROUNDS = 3
WAYS = ("direct", "buffered", "mapped, other process", "mapped, this process")
_CHUNK = 8 << 20
_MADV_HUGEPAGE = 14
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _pin(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})


def _read_preads(path: str, direct: bool, stop) -> int:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0) | os.O_CLOEXEC)
    buffer, total = mmap.mmap(-1, _CHUNK), 0
    try:
        while not stop.is_set():
            if not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            at = 0
            while not stop.is_set() and (n := os.preadv(fd, [buffer], at)) > 0:
                at += n
            total += at
    finally:
        os.close(fd)
        buffer.close()
    return total


def _read_mapped(path: str, stop) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    size, total = os.fstat(fd).st_size, 0
    try:
        while not stop.is_set():
            address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if address in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {path}")
            _libc.madvise(address, size, _MADV_HUGEPAGE)
            flat = torch.frombuffer((ctypes.c_char * size).from_address(address), dtype=torch.uint8)
            flat[::4096].sum()  # one touch a page, without the GIL
            del flat
            _libc.munmap(address, size)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += size
    finally:
        os.close(fd)
    return total


def _reader(way: str, path: str, stop, rates) -> None:
    _pin(1)
    torch.set_num_threads(1)
    began = time.perf_counter()
    total = _read_mapped(path, stop) if way.startswith("mapped") else _read_preads(path, way == "direct", stop)
    rates.put(total / (time.perf_counter() - began))


def _computes() -> dict:
    small = torch.randn(256, 256)
    weights = torch.randn(64, 2048, 4096, dtype=torch.bfloat16)  # 1 GiB
    x = torch.randn(8, 4096, dtype=torch.bfloat16)

    def alu() -> float:
        began = time.perf_counter()
        for _ in range(1500):
            small @ small
        return time.perf_counter() - began

    def gemv() -> float:
        began = time.perf_counter()
        for _ in range(4):
            for block in weights:
                x @ block.T
        return time.perf_counter() - began

    return {"alu": alu, "gemv": gemv}


def _beside(way: str | None, path: str, computes: dict) -> tuple[dict, float | None]:
    """Each compute's best of three seconds, beside ``way``'s reader (or alone); the reader's rate."""
    stop, rates, reader = None, None, None
    if way is not None:
        if way == "mapped, this process":
            stop, rates = threading.Event(), _Queue()
            reader = threading.Thread(target=_reader, args=(way, path, stop, rates))
        else:
            stop, rates = mp.Event(), mp.Queue()
            reader = mp.Process(target=_reader, args=(way, path, stop, rates))
        reader.start()
        time.sleep(0.3)  # the reader under way
    try:
        seconds = {name: min(fn() for _ in range(3)) for name, fn in computes.items()}
    finally:
        if reader is not None:
            stop.set()
            reader.join()
    return seconds, (rates.get() if rates is not None else None)


class _Queue:
    """One value handed back from a thread (``put``, ``get``), as ``mp.Queue`` from a process."""

    def __init__(self):
        self.value = None

    def put(self, value) -> None:
        self.value = value

    def get(self):
        return self.value


def _scratch(folder: str, nbytes: int) -> str:
    path = os.path.join(folder, "scratch.bin")
    with open(path, "wb") as handle:
        for _ in range(0, nbytes, _CHUNK):
            handle.write(os.urandom(_CHUNK))
        os.fsync(handle.fileno())
    return path


def main() -> None:
    args = bench_args(__doc__.splitlines()[0], "1GiB", "64MiB")
    if os.cpu_count() is None or len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("read_interference needs two cores: a compute on one, a reader on the other")
    tmp = workdir(args)
    slowdowns: dict[str, dict[str, list[float]]] = {way: {"alu": [], "gemv": []} for way in WAYS}
    reader_rates: dict[str, list[float]] = {way: [] for way in WAYS}
    try:
        path = _scratch(args.workdir, args.size_bytes)
        _pin(0)
        torch.set_num_threads(1)
        computes = _computes()
        _beside(None, path, computes)  # warm: kernels chosen, weights touched
        for round_ in range(ROUNDS):
            order = WAYS if round_ % 2 == 0 else WAYS[::-1]
            alone, _ = _beside(None, path, computes)
            for way in order:
                seconds, rate = _beside(way, path, computes)
                reader_rates[way].append(rate)
                for name in computes:
                    slowdowns[way][name].append(seconds[name] / alone[name])
    finally:
        if tmp is not None:
            tmp.cleanup()
    lines = [f"a compute on core 0 (one thread) beside a reader on core 1 reading {format_size(args.size_bytes)} "
             f"over and over; {ROUNDS} rounds, medians, each against the compute alone in its round"]
    for way in WAYS:
        alu, gemv = (statistics.median(slowdowns[way][k]) for k in ("alu", "gemv"))
        lines.append(f"  {way:<22} alu {alu:.2f}x, gemv {gemv:.2f}x; reader "
                     f"{format_size(statistics.median(reader_rates[way]))}/s  (gemv rounds: "
                     f"{', '.join(f'{s:.2f}' for s in slowdowns[way]['gemv'])})")
    report("read_interference", lines, {"file_bytes": args.size_bytes, "slowdown": slowdowns,
                                        "reader_bytes_per_s": reader_rates})


if __name__ == "__main__":
    main()
