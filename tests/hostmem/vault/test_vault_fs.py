"""Layer data reaches the disk without passing through the page cache where it can.

Whether a page of a file is in the page cache is asked of the kernel itself: mincore
over a mapping of the file that is never touched (a probing read would start readahead,
which fills the very pages it asks about).
"""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest

from hostmem.vault.durable import DIRECT_ALIGN, open_tmp, write_uncached
from tests.page_cache import cached_pages

PAGE = DIRECT_ALIGN


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
    assert PAGE == mmap.PAGESIZE
    header, *body, tail = cached_pages(path)
    assert body == [False, False, False] and tail
    with open(path, "rb") as handle:
        assert handle.read()[PAGE:] == expected  # and the bytes are all there, in order


def test_a_buffer_off_a_page_boundary_is_written_through_the_page_cache(tmp_path):
    path, expected = _written(tmp_path, skew=64)
    assert all(cached_pages(path)[1:])
    assert os.path.getsize(path) == PAGE + len(expected)
    with open(path, "rb") as handle:
        assert handle.read()[PAGE:] == expected


def test_a_temporary_name_that_is_no_regular_file_is_never_opened_by_the_cleanup(tmp_path):
    """The cleanup of dead writers' temporary files opens one to take its lock: a FIFO (or a
    device node) under such a name is left alone unopened, as the cache never opens what is
    not a regular file (asked of Python's audit hook in a fresh interpreter)."""
    import json

    from tests.conftest import run_python

    fifo = tmp_path / ".tmp-4242-0badf00d"
    os.mkfifo(fifo)
    done = run_python("""
        import json, os, sys
        from hostmem.vault.durable import remove_if_abandoned
        opened = []
        sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" else None)
        gone = remove_if_abandoned(sys.argv[1])
        print(json.dumps({"gone": gone, "opened": [p for p in opened if ".tmp-" in p]}))
    """, os.fspath(fifo))
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said == {"gone": False, "opened": []} and fifo.exists()
