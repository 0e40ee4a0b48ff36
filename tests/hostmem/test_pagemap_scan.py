"""The page-table scan of shared file mappings against pagemap's own entries.

A MAP_SHARED file area is classified from ``PAGEMAP_SCAN`` runs (present, swapped)
instead of 8-byte entries; these tests hold the two readings equal, page for page and
byte for byte, on real mappings with holes in them.
"""

import ctypes
import mmap
import os

import pytest

from hostmem.areas import AreaKind, AreaSnapshot
from hostmem.pagemap import SCAN_PRESENT, PagemapReader
from hostmem.procfs import PAGE_SIZE
from hostmem.residency import RangeClassifier

PAGES = 1500  # alternating present pages: more runs than one scan call returns


@pytest.fixture
def holey_mapping(tmp_path):
    """A shared mapping of a file, every page read, then every other page dropped from
    this process's page table (the file's pages stay in the page cache).

    The file is written a page at a time so that its page cache holds single pages: a
    large folio mapped by one PMD would be dropped whole by the first MADV_DONTNEED.
    """
    path = tmp_path / "pages.bin"
    with open(path, "wb", buffering=0) as out:
        for _ in range(PAGES):
            out.write(os.urandom(PAGE_SIZE))
    with open(path, "r+b") as handle:
        area = mmap.mmap(handle.fileno(), 0, flags=mmap.MAP_SHARED)
    view = ctypes.c_char.from_buffer(area)
    start = ctypes.addressof(view)
    sum(area[i * PAGE_SIZE] for i in range(PAGES))
    for page in range(1, PAGES, 2):
        area.madvise(mmap.MADV_DONTNEED, page * PAGE_SIZE, PAGE_SIZE)
    yield start, start + PAGES * PAGE_SIZE
    del view
    area.close()


def _scan_or_skip(reader: PagemapReader, start: int, end: int):
    runs = reader.scan(start, end)
    if runs is None:
        pytest.skip("this kernel has no PAGEMAP_SCAN (Linux 6.7+): entries are read instead")
    return runs


def test_scan_runs_are_exactly_the_present_pages(holey_mapping):
    start, end = holey_mapping
    with PagemapReader() as reader:
        runs = _scan_or_skip(reader, start, end)
        entries = reader.read_bytes(start, end)
    present = {(start + i * PAGE_SIZE) for i in range(PAGES) if entries[8 * i + 7] & 0x80}
    scanned = {page for lo, hi, kind in runs if kind == SCAN_PRESENT for page in range(lo, hi, PAGE_SIZE)}
    assert scanned == present
    assert len(runs) > 512  # the walk resumed after a full batch of runs
    assert len(present) == (PAGES + 1) // 2


def test_shared_file_area_codes_equal_pagemap_entries(holey_mapping):
    start, end = holey_mapping
    with AreaSnapshot() as snapshot:
        _scan_or_skip(snapshot._pagemap, start, end)
        vma = next(v for v in snapshot.vmas if v.start <= start < v.end)
        assert snapshot.area_kind(vma) == AreaKind.FILE_SHARED
        # Offsets inside the area: gaps at both ends are read from pagemap's entries.
        for lo, hi in ((start, end), (start + 3 * PAGE_SIZE, end - 5 * PAGE_SIZE)):
            assert snapshot.page_codes(AreaKind.FILE_SHARED, lo, hi) == snapshot.page_codes(AreaKind.FILE, lo, hi)
        assert snapshot.classify_whole_area(vma).file_backed == (PAGES + 1) // 2 * PAGE_SIZE


def test_ranges_classify_the_same_with_the_scan_off(holey_mapping):
    """Byte counts of ranges that start and end inside pages, with and without the scan."""
    start, end = holey_mapping
    page = PAGE_SIZE
    ranges = [(start + 100, start + 7 * page + 5), (start, end), (start + 4 * page - 1, start + 4 * page + 1),
              (start + 10 * page, start + 11 * page), (start + 11 * page, start + 12 * page)]
    with RangeClassifier() as scanned, RangeClassifier() as read:
        _scan_or_skip(scanned._pagemap, start, end)
        read._pagemap._scan_supported = False
        with_scan = scanned.classify_many(ranges)
        assert with_scan == read.classify_many(ranges)
    assert with_scan[3].file_backed == PAGE_SIZE and with_scan[4].not_resident == PAGE_SIZE
    assert with_scan[1].file_backed + with_scan[1].not_resident == end - start


def test_private_copies_counts_the_pages_a_private_file_mapping_copied_on_write(tmp_path):
    path = tmp_path / "private.bin"
    original = os.urandom(64 * PAGE_SIZE)
    path.write_bytes(original)
    with open(path, "r+b") as handle:
        mapping = mmap.mmap(handle.fileno(), 0, flags=mmap.MAP_PRIVATE)
    anchor = ctypes.c_char.from_buffer(mapping)
    start = ctypes.addressof(anchor)
    try:
        assert bytes(mapping[i * PAGE_SIZE] for i in range(64)) == original[::PAGE_SIZE]  # every page read
        with PagemapReader() as pages:
            assert pages.private_copies(start, start + 64 * PAGE_SIZE) == 0
            for i in (3, 4, 40):
                mapping[i * PAGE_SIZE] = mapping[i * PAGE_SIZE] ^ 1  # written: a copy of that page
            assert pages.private_copies(start, start + 64 * PAGE_SIZE) == 3
            assert pages.private_copies(start + 5 * PAGE_SIZE, start + 40 * PAGE_SIZE) == 0
    finally:
        del anchor
        mapping.close()
    assert path.read_bytes() == original  # the copies were the process's own, never the file's
