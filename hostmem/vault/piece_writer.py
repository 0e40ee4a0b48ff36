"""A layer's bytes written to disk in pieces, several at once, handed back in order.

A streamed layer (see :mod:`hostmem.vault.handoff`) is summed into the one buffer the
next layer reuses: each byte the writer has put on disk may be overwritten by the next
layer's sum. Written as one large ``pwrite`` per stretch, a stretch is handed back only
when all of it is on disk, so on a layer not much larger than a stretch the sum and the
disk take turns instead of overlapping (measured on a 2-core virtual machine with 21 MiB
layers: the summing threads waited on the writer for 40% of their time, the writer on
the sum for 15% of its own). Here each piece is one request as the disk takes it
(:data:`PIECE_BYTES`, or up to :data:`LARGEST_PIECE` of what is ready already, so that
a writer starved of CPU by other load wakes less often per byte), :data:`IN_FLIGHT` of
them on their way at once, so the disk's queue stays as deep as with one large write,
while the bytes go back to the merge a piece at a time, as soon as every piece before
them is written too. The CRC-32 is taken in order, here, of each piece just after it
is issued (taken before, the disk waited for it at every refill of its queue: a virtio
disk answers the requests it holds in one batch, so its queue empties at once), and a
piece goes back to the merge once it is both written and checksummed.

A session's puts share one :class:`PieceWriter`: its :data:`IN_FLIGHT` pieces may
belong to two layers, so the disk's queue does not drain at the end of each layer (the
put of layer i returns once its last piece is on its way and its header written; the
seal waits for the pieces, :meth:`Pieces.end`, before its fsync). Draining at the end
of each of 48 layers of 21 MiB, a 2-core virtual machine's disk was busy about 60% of
the time, its queue about 2.5 requests deep on average (11 for one large write).
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from .durable import write_uncached
from .handoff import Handoff

__all__ = ["IN_FLIGHT", "LARGEST_PIECE", "PIECE_BYTES", "PieceWriter", "Pieces", "write_pieces"]

PIECE_BYTES = 4 * 1024 * 1024  # the smallest piece: one request of a virtio disk (max_sectors_kb 4096)
LARGEST_PIECE = 16 * 1024 * 1024  # where more is ready: fewer wakeups of the writing threads
IN_FLIGHT = 4  # pieces written at once: at least 16 MiB queued, as one 16 MiB write queues it
_ALIGN = 4096  # every piece but a layer's last ends on a page, so each goes with O_DIRECT


class _Released:
    """Hands ``[0, end)`` back to the handoff once every piece below ``end`` is written and
    checksummed, whatever order the pieces finish in (each piece's done callback calls
    :meth:`done`; the checksum, taken in order, calls :meth:`summed`)."""

    def __init__(self, handoff: Handoff):
        self.handoff = handoff
        self._finished: set[int] = set()
        self._order: deque[tuple[int, int]] = deque()  # (start, end) of the pieces issued, in order
        self._written = 0  # every byte below is on disk
        self._summed = 0  # every byte below is in the checksum
        self._lock = threading.Lock()

    def issued(self, start: int, end: int) -> None:
        with self._lock:
            self._order.append((start, end))

    def done(self, start: int, future: Future) -> None:
        if future.cancelled() or future.exception() is not None:
            return  # never handed back: the writer raises, and the put releases everything
        with self._lock:
            self._finished.add(start)
            while self._order and self._order[0][0] in self._finished:
                first, self._written = self._order.popleft()
                self._finished.discard(first)
        self._hand_back()

    def summed(self, end: int) -> None:
        with self._lock:
            self._summed = end
        self._hand_back()

    def _hand_back(self) -> None:
        with self._lock:
            end = min(self._written, self._summed)
        if end:
            self.handoff.release(end)


class Pieces:
    """One layer's pieces on their way: each handed back in order as it is written."""

    def __init__(self, handoff: Handoff):
        self._released = _Released(handoff)
        self._futures: list[Future] = []

    def add(self, future: Future, start: int, end: int) -> None:
        self._released.issued(start, end)
        future.add_done_callback(lambda f: self._released.done(start, f))
        self._futures.append(future)

    def summed(self, end: int) -> None:
        """Every byte below ``end`` is in the checksum (none of it may change before)."""
        self._released.summed(end)

    def wait(self) -> None:
        """Block until every piece has ended; raise the first piece's error."""
        error = None
        for future in self._futures:
            try:
                future.result()
            except BaseException as exc:  # a cancelled piece too: the layer is not whole
                error = error or exc
        if error is not None:
            raise error

    def end(self) -> None:
        """:meth:`wait`, then hand the whole buffer back however the pieces ended (nothing
        writes from it any more: the merge may reuse it)."""
        try:
            self.wait()
        finally:
            self._released.handoff.release()

    def abandon(self) -> None:
        """Cancel the pieces not yet started and wait for the others; errors are the caller's to report."""
        for future in self._futures:
            future.cancel()
        with contextlib.suppress(BaseException):
            self.wait()


class PieceWriter:
    """Threads that write pieces, :data:`IN_FLIGHT` at once whatever layer they belong to."""

    def __init__(self, name: str = "hostmem-vault-write"):
        self._pool = ThreadPoolExecutor(IN_FLIGHT, name)
        self._slots = threading.Semaphore(IN_FLIGHT)
        self.started: Pieces | None = None  # the last layer's, for its put to take (see layer_file)

    def start(self, fd: int, path: str, data: memoryview, offset: int, address: int, handoff: Handoff,
              digest, write=write_uncached) -> Pieces:
        """Issue ``data`` (at ``address`` in memory) at ``offset`` of ``path`` (open as ``fd``)
        in pieces as ``handoff`` publishes it, feeding ``digest`` in order; return once the
        last piece is on its way (``digest`` is then whole). Each piece goes by ``write``
        (:func:`~hostmem.vault.durable.write_uncached`, or ``write_cached`` to leave the
        bytes in the page cache). On an error, the pieces issued have ended before it is
        raised."""
        pieces = Pieces(handoff)
        done = 0
        try:
            while done < len(data):
                ready = handoff.wait_ready(done, PIECE_BYTES)
                end = min(ready, done + LARGEST_PIECE)
                if end < len(data):
                    end -= end % _ALIGN
                self._slots.acquire()
                future = self._pool.submit(write, fd, path, data[done:end], offset + done, address + done)
                future.add_done_callback(lambda _: self._slots.release())
                pieces.add(future, done, end)
                digest.update(data[done:end])  # while it is on its way: the disk's queue refills first
                pieces.summed(end)
                done = end
        except BaseException:
            pieces.abandon()
            raise
        return pieces

    def close(self) -> None:
        """End the threads once the pieces on their way are written."""
        self._pool.shutdown(wait=True)


def write_pieces(fd: int, path: str, data: memoryview, offset: int, address: int, handoff: Handoff,
                 digest, write=write_uncached) -> None:
    """Write ``data`` (at ``address`` in memory) at ``offset`` of ``path`` (open as ``fd``) as
    ``handoff`` publishes it, :data:`IN_FLIGHT` pieces at a time, feeding ``digest`` in order,
    on threads of its own, each piece by ``write`` (as :meth:`PieceWriter.start`).

    Returns once every piece is written; on any error, once the pieces already on their
    way have ended (nothing writes the file after this returns or raises).
    """
    writer = PieceWriter()
    try:
        writer.start(fd, path, data, offset, address, handoff, digest, write).wait()
    finally:
        writer.close()
