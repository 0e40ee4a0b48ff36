"""Which pages a released layer may drop: its own, less those another layer still needs.

Layers can share bytes (a buffer two blocks hold, a tied weight, two views of one
file page at a tensor boundary). A released layer's release must not drop a page that
a kept, pinned or resident layer, the component's tensors outside its layers, or a
layer read ahead and not yet run also lie on: the first would be read again from disk,
a pinned page refuses the release, and a read-ahead would be lost. So a release is cut
into the pieces of the layer's whole pages that no protected interval covers.
"""

from __future__ import annotations

from bisect import bisect_right

from hostmem.procfs import PAGE_SIZE

from .layout import FileRange, inner_pages

__all__ = ["Intervals", "ReleasesInFlight", "free_pieces", "page_cover", "released_bytes"]

_FOLIO = 2 << 20


def page_cover(ranges) -> list[tuple[int, int]]:
    """``[start, end)`` address intervals of every page the ranges touch (rounded outward)."""
    return [(r.address - r.address % PAGE_SIZE, r.address + r.length + (-(r.address + r.length)) % PAGE_SIZE)
            for r in ranges if r.length]


class Intervals:
    """A sorted, merged set of address intervals, asked what they leave of a range."""

    def __init__(self, intervals=()):
        merged: list[list[int]] = []
        for start, end in sorted(intervals):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        self.starts = [s for s, _ in merged]
        self.ends = [e for _, e in merged]

    def __bool__(self) -> bool:
        return bool(self.starts)

    def overlaps(self, start: int, end: int) -> bool:
        i = bisect_right(self.starts, end - 1) - 1
        return i >= 0 and self.ends[i] > start

    def gaps(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of ``[start, end)`` no interval covers."""
        out, at = [], start
        i = max(0, bisect_right(self.starts, start) - 1)
        while i < len(self.starts) and self.starts[i] < end and at < end:
            if self.ends[i] > at:
                if self.starts[i] > at:
                    out.append((at, self.starts[i]))
                at = max(at, self.ends[i])
            i += 1
        if at < end:
            out.append((at, end))
        return out


def _piece(r: FileRange, start: int, end: int) -> FileRange:
    return r._replace(offset=r.offset + start - r.address, length=end - start, address=start)


def free_pieces(ranges, floors, protected: list[Intervals], below: list[Intervals]) -> list[tuple[FileRange, bool]]:
    """``(piece, back)``: the whole pages of ``ranges`` outside every ``protected`` set, and whether
    the release may reach down to the start of the piece's 2 MiB folio (inside the range's file
    mapping, which begins at its ``floors`` entry, and none of ``below`` there).

    A folio straddling a released layer's start is dropped only whole; reaching into a kept
    layer's last pages costs their re-read, keeping it would hold up to 2 MiB per kept layer
    beyond the plan, so ``below`` names only what must never go: pinned pages, the rest, the window.
    """
    out = []
    for r, floor in zip(ranges, floors):
        start, length = inner_pages(r)
        gaps = [(start, start + length)] if length else []
        for guard in protected:
            gaps = [g for a, b in gaps for g in guard.gaps(a, b)]
        for a, b in gaps:
            folio = a - a % _FOLIO
            back = floor <= folio < a and not any(guard.overlaps(folio, a) for guard in below)
            out.append((_piece(r, a, b), back))
    return out


def released_bytes(pieces) -> int:
    """The bytes a release of ``pieces`` (from :func:`free_pieces`) drops: their whole pages."""
    return sum(inner_pages(piece)[1] for piece, _ in pieces)


class ReleasesInFlight:
    """Releases handed to another thread, and the pages each may drop.

    A layer read again before its release ran (a short pass, a repeat, the next pass's
    first layers) waits for that release first: run after the read, it would drop what
    was just read, and the layer would be read twice.
    """

    def __init__(self):
        self._flight: list[tuple[Intervals, object]] = []

    def add(self, pieces, future) -> None:
        """``future`` drops ``pieces`` (``(piece, back)`` pairs, see :func:`free_pieces`)."""
        spans = [(piece.address - piece.address % _FOLIO if back else piece.address, piece.address + piece.length)
                 for piece, back in pieces]
        self._flight = [(s, f) for s, f in self._flight if not f.done()]
        self._flight.append((Intervals(spans), future))

    def wait_for(self, ranges) -> None:
        """Return once no release in flight may drop a page of ``ranges``."""
        if not self._flight:
            return
        cover = page_cover(ranges)
        still = []
        for spans, future in self._flight:
            if future.done():
                continue
            if any(spans.overlaps(a, b) for a, b in cover):
                future.result()  # the job reports its own failures
            else:
                still.append((spans, future))
        self._flight = still
