"""What a release may drop (planners.executor.pages): a layer's own whole pages, less those another
layer needs, and a straddling folio's lower part only inside the same file mapping."""

from __future__ import annotations

from planners.executor.layout import FileRange
from planners.executor.pages import Intervals, free_pieces, page_cover

P, FOLIO = 4096, 2 << 20


def _range(address, length, offset=None):
    return FileRange("f", address - 0x10000000 if offset is None else offset, length, address, False)


def test_gaps_leave_out_every_protected_interval():
    guard = Intervals([(10 * P, 12 * P), (11 * P, 13 * P), (20 * P, 21 * P)])  # overlapping ones merge
    assert guard.gaps(8 * P, 24 * P) == [(8 * P, 10 * P), (13 * P, 20 * P), (21 * P, 24 * P)]
    assert guard.gaps(10 * P, 13 * P) == [] and guard.overlaps(12 * P, 12 * P + 1)
    assert not guard.overlaps(13 * P, 20 * P) and Intervals().gaps(0, P) == [(0, P)]


def test_a_page_another_layer_reads_is_not_released():
    base = 0x10000000 + FOLIO + 100  # a layer that starts 100 bytes into a page
    layer = _range(base, 8 * P)
    shared = page_cover([_range(base + 3 * P, 10)])  # a tensor another layer reads too
    pieces = free_pieces([layer], [0x10000000], [Intervals(shared)], [])
    spans = [(p.address, p.address + p.length) for p, _ in pieces]
    first = base + P - 100
    assert spans == [(first, first + 2 * P), (first + 3 * P, first + 7 * P)]  # whole pages inside, not page 3
    assert all(p.offset == p.address - 0x10000000 for p, _ in pieces)


def test_a_release_reaches_down_a_folio_only_inside_the_mapping():
    mapping = 0x10000000 + 5 * P  # a mapping that does not begin at a folio boundary
    near = _range(mapping + 2 * P, 4 * P, offset=2 * P)
    ((_, back),) = free_pieces([near], [mapping], [], [])
    assert back is False  # the folio's start lies below the mapping: anything may be there
    far = _range(mapping + FOLIO + 2 * P, 4 * P, offset=FOLIO + 2 * P)
    ((_, back),) = free_pieces([far], [mapping], [], [])
    assert back is True
    ((_, back),) = free_pieces([far], [mapping], [], [Intervals([(mapping + FOLIO, mapping + FOLIO + P)])])
    assert back is False  # a pinned page or the rest below: never
