"""Pinning backends against the real kernel: VmLck, smaps Locked, pagemap, RLIMIT_MEMLOCK."""

from __future__ import annotations

import errno
import gc
import mmap
import os
import resource
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from hostmem.pinning import (
    CudaHostRegisterBackend,
    MlockBackend,
    Pinner,
    PinError,
    default_backend,
    drop_page_cache,
    page_span,
    replaced,
)
from hostmem.procfs import PAGE_SIZE, read_smaps, read_status
from hostmem.residency import classify_range
from hostmem.safetensors.mapping import load_readonly
from tests.conftest import run_python, write_safetensors

MiB = 1024 * 1024


def _locked_in_smaps() -> int:
    return sum(v.locked for v in read_smaps())


@pytest.fixture(autouse=True)
def _nothing_left_to_unlock_by_a_collection():
    """A pin an earlier test of this process dropped in a reference cycle is unlocked when
    the collector finds it: here, before a test reads VmLck, not in the middle of it."""
    gc.collect()


@pytest.fixture
def mapped(tmp_path):
    """Three read-only mapped tensors whose boundaries fall inside pages."""
    path = write_safetensors(
        tmp_path / "w.safetensors",
        {"a": torch.ones(MiB + 3, dtype=torch.uint8), "b": torch.ones(2 * MiB + 5, dtype=torch.uint8),
         "c": torch.ones(MiB, dtype=torch.uint8)},
    )
    return load_readonly(path)


def test_mlock_locks_exactly_the_pages_under_a_tensor(mapped):
    t = mapped["b"]
    start, end = page_span(t)
    assert start % PAGE_SIZE == 0 and end % PAGE_SIZE == 0 and end - start - t.nbytes < 2 * PAGE_SIZE
    vm_before, smaps_before = read_status().vm_lck, _locked_in_smaps()
    with Pinner(MlockBackend()) as pinner:
        assert pinner.pin("b", [t]) == end - start
        assert read_status().vm_lck - vm_before == end - start
        assert _locked_in_smaps() - smaps_before == end - start
        assert classify_range(t.data_ptr(), t.data_ptr() + t.nbytes).pinned == t.nbytes
    assert read_status().vm_lck == vm_before
    assert classify_range(t.data_ptr(), t.data_ptr() + t.nbytes).pinned == 0


def test_a_shared_page_is_locked_once_and_kept_for_the_neighbour(mapped):
    a, b = mapped["a"], mapped["b"]
    assert page_span(a)[1] > page_span(b)[0]  # they share a page
    vm_before = read_status().vm_lck
    pinner = Pinner(MlockBackend())
    locked_a = pinner.pin("a", [a])
    locked_b = pinner.pin("b", [b])
    union = page_span(b)[1] - page_span(a)[0]
    assert locked_a + locked_b == union == pinner.locked_bytes == read_status().vm_lck - vm_before
    assert pinner.would_lock([a, b]) == 0
    released = pinner.unpin("a")
    assert released == locked_a - PAGE_SIZE  # the shared page stays, now held for b
    assert classify_range(b.data_ptr(), b.data_ptr() + b.nbytes).pinned == b.nbytes
    assert read_status().vm_lck - vm_before == page_span(b)[1] - page_span(b)[0]
    pinner.unpin_all()
    assert read_status().vm_lck == vm_before and pinner.locked_bytes == 0


def test_pinning_page_cache_in_place_makes_no_copy(mapped):
    t = mapped["b"]
    torch.sum(t)  # the layer is page cache now
    assert classify_range(t.data_ptr(), t.data_ptr() + t.nbytes).file_backed == t.nbytes
    before = read_status()
    with Pinner(MlockBackend()) as pinner:
        pinner.pin("b", [t])
        after = read_status()
        assert after.rss_anon - before.rss_anon < MiB  # no anonymous copy of 2 MiB
        assert after.rss_file - before.rss_file < MiB  # the same cached pages, now locked
        assert after.vm_lck - before.vm_lck == pinner.locked_bytes


def test_the_page_cache_behind_a_copied_pin_can_be_dropped_and_is_measured(mapped):
    original = mapped["b"]
    torch.sum(original)
    copy = original.clone()  # a pin made as a copy (what pin_memory() does)
    with Pinner(MlockBackend()) as pinner:
        pinner.pin("copy", [copy])
        assert classify_range(copy.data_ptr(), copy.data_ptr() + copy.nbytes).pinned == copy.nbytes
        start, end = page_span(original)
        cached = classify_range(start, end).file_backed
        assert cached == end - start  # the page cache the pin duplicates
        assert drop_page_cache(original) == cached
        assert classify_range(start, end).file_backed == 0
    assert torch.equal(original, copy)  # dropped pages come back from the file on demand


def test_mlock_refused_by_rlimit_memlock_says_how_to_raise_it():
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    code = """
        import mmap, ctypes
        from hostmem.pinning import MlockBackend, PinError
        buf = mmap.mmap(-1, 64 << 20)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        try:
            MlockBackend().lock(addr, 64 << 20)
        except PinError as exc:
            print("ERRNO", exc.errno)
            print(exc)
        else:
            print("LOCKED")
    """
    child = run_python(code, timeout=60)
    if "ERRNO" in child.stdout:
        pytest.skip("this process cannot mlock 64 MiB even with its capabilities")
    assert "LOCKED" in child.stdout, child.stderr
    setpriv = ["setpriv", "--bounding-set=-ipc_lock", "--inh-caps=-ipc_lock"]
    # The limit a host sets may let 64 MiB through (some give root an unlimited one):
    # the child gets 8 MiB, lowered as any process may lower its own.
    _, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    soft = 8 << 20 if hard == resource.RLIM_INFINITY else min(8 << 20, hard)
    capless = subprocess.run([*setpriv, sys.executable, "-c", textwrap.dedent(code)],
                             capture_output=True, text=True, timeout=60,
                             preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard)))
    if capless.returncode != 0 and "setpriv" in capless.stderr:
        pytest.skip(f"setpriv cannot drop CAP_IPC_LOCK here: {capless.stderr.strip()}")
    assert f"ERRNO {errno.ENOMEM}" in capless.stdout, capless.stdout + capless.stderr
    assert "RLIMIT_MEMLOCK is" in capless.stdout and "ulimit -l" in capless.stdout


def test_the_cuda_backend_needs_a_device():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present; see the next test")
    with pytest.raises(PinError, match="no CUDA device") as caught:
        CudaHostRegisterBackend()
    assert caught.value.errno == errno.ENODEV
    assert isinstance(default_backend(), MlockBackend)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_registers_a_read_only_mapping_in_place(mapped):
    t = mapped["b"]
    with Pinner(CudaHostRegisterBackend()) as pinner:
        pinner.pin("b", [t])
        assert t.is_pinned()
        assert torch.equal(t.to("cuda", non_blocking=True).cpu(), t)
    assert not t.is_pinned()


def test_anonymous_memory_is_locked_in_place_too():
    buf = mmap.mmap(-1, 4 * MiB)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    t.fill_(1)
    before = read_status().vm_lck
    with Pinner(MlockBackend()) as pinner:
        pinner.pin("anon", [t])
        assert read_status().vm_lck - before == 4 * MiB
        assert classify_range(t.data_ptr(), t.data_ptr() + t.nbytes).pinned == 4 * MiB
    assert os.sysconf("SC_PAGE_SIZE") == PAGE_SIZE


def test_a_pin_follows_its_replacement_and_hands_a_shared_page_to_the_neighbour(mapped):
    a, b, c = mapped["a"], mapped["b"], mapped["c"]
    vm_before = read_status().vm_lck
    with Pinner(MlockBackend()) as pinner:
        pinner.pin("a", [a])
        pinner.pin("b", [b])
        replaced(a, c)  # what a merge's install says when c takes a's place

        assert pinner.tensors("a") == [c] and pinner.released == []
        union = page_span(c)[1] - page_span(b)[0]  # b and c share a page, as a and b did
        assert pinner.locked_bytes == union == read_status().vm_lck - vm_before
        assert classify_range(a.data_ptr(), page_span(b)[0]).pinned == 0  # a's own pages let go
        assert classify_range(b.data_ptr(), b.data_ptr() + b.nbytes).pinned == b.nbytes
        assert classify_range(c.data_ptr(), c.data_ptr() + c.nbytes).pinned == c.nbytes
        replaced(torch.ones(3), torch.zeros(3))  # a tensor no pin holds: nothing changes
        assert pinner.locked_bytes == union
    assert read_status().vm_lck == vm_before


def test_a_replacement_over_the_cap_releases_the_key(mapped):
    a, b = mapped["a"], mapped["b"]
    vm_before = read_status().vm_lck
    with Pinner(MlockBackend(), max_locked=MiB + 2 * PAGE_SIZE) as pinner:
        pinner.pin("a", [a])
        replaced(a, b)  # b takes 2 MiB: more than the cap

        assert pinner.released == ["a"] and pinner.keys() == [] and pinner.locked_bytes == 0
        assert read_status().vm_lck == vm_before


class WholeRegistrations(MlockBackend):
    """mlock, held to cudaHostRegister's rule: a range is undone whole, from where it was made."""

    splits = False

    def __init__(self):
        super().__init__()
        self.made: dict[int, int] = {}

    def lock(self, start: int, length: int) -> None:
        super().lock(start, length)
        self.made[start] = length

    def unlock(self, start: int, length: int) -> None:
        assert self.made.pop(start, None) == length, f"{length} bytes at {start:#x} were never registered as such"
        super().unlock(start, length)


def test_a_backend_that_undoes_registrations_whole_follows_too(mapped):
    a, b, c = mapped["a"], mapped["b"], mapped["c"]
    vm_before = read_status().vm_lck
    backend = WholeRegistrations()
    with Pinner(backend) as pinner:
        pinner.pin("a", [a])
        pinner.pin("b", [b])
        replaced(a, c)
        assert pinner.tensors("a") == [c]
        assert pinner.locked_bytes == page_span(c)[1] - page_span(b)[0] == read_status().vm_lck - vm_before
    assert read_status().vm_lck == vm_before and backend.made == {}


def test_a_pinner_dropped_without_unpinning_unlocks_what_it_held():
    # heap tensors (freed to the allocator, not unmapped): a lock left behind would stay on
    # pages that later allocations reuse, and the ledger would count them pinned
    import gc

    gc.collect()  # another test's pinner let go before this one: collected now, not inside the measure
    vm_before = read_status().vm_lck
    pinner = Pinner(MlockBackend())
    pinner.pin("a", [torch.randn(3000)])  # under a page's worth of rows: heap memory
    assert read_status().vm_lck > vm_before
    del pinner
    gc.collect()
    assert read_status().vm_lck == vm_before
