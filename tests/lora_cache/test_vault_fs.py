"""Layer data reaches the disk without passing through the page cache where it can.

Whether a page of a file is in the page cache is asked of the kernel itself: a read
with RWF_NOWAIT answers EAGAIN instead of going to the disk for a page it lacks.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest

from lora_cache.vault_fs import DIRECT_ALIGN, open_tmp, write_uncached

PAGE = DIRECT_ALIGN


def _cached(fd: int, offset: int) -> bool:
    try:
        os.preadv(fd, [bytearray(64)], offset, os.RWF_NOWAIT)
    except BlockingIOError:
        return False
    except OSError as exc:  # a kernel or filesystem without RWF_NOWAIT for buffered reads
        pytest.skip(f"cannot ask the page cache with RWF_NOWAIT here: {exc}")
    return True


def _takes_o_direct(folder: str) -> bool:
    """Whether ``folder``'s filesystem accepts an aligned O_DIRECT write (asked directly,
    not through the code under test, so a broken write_uncached cannot skip its test)."""
    page = mmap.mmap(-1, PAGE)
    path = os.path.join(folder, "probe-o-direct")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            os.pwrite(fd, page, 0)
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return True


def _written(tmp_path, skew: int) -> tuple[str, bytes]:
    """Write 3 pages + 100 bytes after a one-page header from a buffer ``skew`` bytes off a page."""
    buffer = mmap.mmap(-1, 5 * PAGE)
    buffer.write(os.urandom(5 * PAGE))
    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer)) + skew
    data = memoryview(buffer)[skew : skew + 3 * PAGE + 100]
    fd, path = open_tmp(str(tmp_path))
    try:
        write_uncached(fd, path, data, PAGE, address)
        os.fsync(fd)
    finally:
        os.close(fd)
    expected = bytes(data)
    data.release()
    return path, expected


def test_whole_pages_skip_the_page_cache_and_the_partial_last_page_goes_through_it(tmp_path):
    if not _takes_o_direct(str(tmp_path)):
        pytest.skip("this filesystem takes no O_DIRECT writes (the fallback writes everything cached)")
    path, expected = _written(tmp_path, skew=0)
    with open(path, "rb") as handle:
        fd = handle.fileno()
        body = [_cached(fd, PAGE * (1 + i)) for i in range(3)]
        tail = _cached(fd, 4 * PAGE)
        assert body == [False, False, False] and tail
        assert handle.read()[PAGE:] == expected  # and the bytes are all there, in order


def test_a_buffer_off_a_page_boundary_is_written_through_the_page_cache(tmp_path):
    path, expected = _written(tmp_path, skew=64)
    with open(path, "rb") as handle:
        assert all(_cached(handle.fileno(), PAGE * (1 + i)) for i in range(4))
        assert os.path.getsize(path) == PAGE + len(expected)
        assert handle.read()[PAGE:] == expected
