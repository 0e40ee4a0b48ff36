"""What a cache miss asks of the disk beyond the in-place merge: does a write overlap a read?

A miss reads its base (as the in-place merge does) and writes the merged bytes with
O_DIRECT while it reads; the in-place merge writes nothing. Where the disk serves a read
and a write at once, the write hides behind the read and the merge; where it takes them
in turn (a virtual disk whose requests one thread of the host serves), the miss pays the
write on top. This probe times, in three rounds: a cold read of a file of ``--size``
(its pages dropped first, 16 MiB reads), an O_DIRECT write of the same bytes (4 MiB
pieces from one buffer, into blocks allocated first, then fsync), and both at once.

    .venv/bin/python bench/disk_overlap.py            # 1 GiB
    .venv/bin/python bench/disk_overlap.py --quick    # 64 MiB
"""

from __future__ import annotations

import mmap
import os
import statistics
import threading
import time

from common import bench_args, drop_from_page_cache, format_size, report, workdir  # noqa: E402

PIECE = 4 << 20
ROUNDS = 3


def read_cold(path: str) -> float:
    """Seconds to read ``path`` whole after its pages are dropped."""
    drop_from_page_cache([path])
    buffer = bytearray(16 << 20)
    fd = os.open(path, os.O_RDONLY)
    try:
        started = time.perf_counter()
        while os.readv(fd, [buffer]) > 0:
            pass
        return time.perf_counter() - started
    finally:
        os.close(fd)


def write_direct(path: str, nbytes: int, piece: mmap.mmap) -> float:
    """Seconds to write ``nbytes`` to a new ``path`` with O_DIRECT, then fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        started = time.perf_counter()
        for at in range(0, nbytes, PIECE):
            os.pwrite(fd, piece, at)
        os.fsync(fd)
        return time.perf_counter() - started
    finally:
        os.close(fd)
        os.unlink(path)


def main() -> None:
    args = bench_args(__doc__.splitlines()[0], "1GiB", "64MiB")
    tmp = workdir(args)
    nbytes = max(PIECE, args.size_bytes - args.size_bytes % PIECE)
    piece = mmap.mmap(-1, PIECE)  # page-aligned, as O_DIRECT needs
    piece.write(os.urandom(PIECE))
    source, target = os.path.join(args.workdir, "read.bin"), os.path.join(args.workdir, "write.bin")
    rounds = []
    try:
        with open(source, "wb") as handle:
            for _ in range(0, nbytes, PIECE):
                handle.write(piece)
            handle.flush()
            os.fsync(handle.fileno())
        for _ in range(ROUNDS):
            alone_read, alone_write = read_cold(source), write_direct(target, nbytes, piece)
            written = {}
            writer = threading.Thread(target=lambda: written.setdefault("s", write_direct(target, nbytes, piece)))
            started = time.perf_counter()
            writer.start()
            together_read = read_cold(source)
            writer.join()
            together = time.perf_counter() - started
            rounds.append({"read_s": alone_read, "write_s": alone_write, "together_s": together,
                           "together_read_s": together_read, "together_write_s": written["s"]})
    finally:
        piece.close()
        if tmp is not None:
            tmp.cleanup()
    med = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    in_turn = med["read_s"] + med["write_s"]
    overlap = med["together_s"] / in_turn
    lines = [f"{format_size(nbytes)} read cold and {format_size(nbytes)} written with O_DIRECT, "
             f"{ROUNDS} rounds, medians",
             f"  alone: read {med['read_s']:.2f} s, write {med['write_s']:.2f} s; one after the other {in_turn:.2f} s",
             f"  at once: {med['together_s']:.2f} s (read {med['together_read_s']:.2f} s, write "
             f"{med['together_write_s']:.2f} s)  -> {overlap:.2f} of one after the other "
             f"({'the disk takes them in turn' if overlap > 0.9 else 'the write overlaps the read'})",
             "  rounds: " + "; ".join(f"{r['read_s']:.2f} + {r['write_s']:.2f} alone, {r['together_s']:.2f} at once"
                                       for r in rounds)]
    report("disk_overlap", lines, {"bytes": nbytes, "rounds": rounds, "medians": med,
                                   "together_over_in_turn": overlap})


if __name__ == "__main__":
    main()
