"""The classifier against real mappings: file pages, copy-on-write pages, heap, mlock, tmpfs."""

import ctypes
import mmap
import os
import signal
import tempfile

import pytest
import torch
from safetensors import safe_open

from hostmem import account, classify_range, load_readonly, open_readonly
from hostmem.procfs import PAGE_SIZE
from tests.conftest import run_python, write_safetensors

MiB = 1024 * 1024


def _range(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def _classify(t: torch.Tensor):
    return classify_range(*_range(t))


def _weights(tmp_path, name="w.safetensors"):
    tensors = {"big": torch.randn(1024, 1024), "small": torch.randn(64, 64)}
    return write_safetensors(tmp_path / name, tensors)


@pytest.mark.parametrize("loader", ["readonly", "safe_open"])
def test_mapped_weights_are_not_resident_before_and_file_backed_after_a_read(tmp_path, loader):
    path = _weights(tmp_path)
    if loader == "readonly":
        big = open_readonly(path).get_tensor("big")
    else:
        with safe_open(path, "pt") as handle:
            big = handle.get_tensor("big")
    before = _classify(big)
    # safe_open reads its header through the mapping; the kernel's fault-around
    # (64 KiB by default) may map the first pages of the tensor with it.
    fault_around = 0 if loader == "readonly" else 64 * 1024
    assert before.not_resident >= big.nbytes - fault_around, before
    assert before.anonymous == 0 and before.file_backed <= fault_around
    float(big.sum())
    after = _classify(big)
    assert after.file_backed == big.nbytes, after
    assert after.anonymous == 0 and after.not_resident == 0


def test_writing_rows_of_a_private_mapping_turns_exactly_those_pages_anonymous(tmp_path):
    path = _weights(tmp_path)
    with safe_open(path, "pt") as handle:
        big = handle.get_tensor("big")  # private, writable mapping (MAP_PRIVATE)
    float(big.sum())
    start, end = _range(big)
    big[:100] += 1.0
    written_end = start + 100 * 1024 * 4
    first_page = start // PAGE_SIZE * PAGE_SIZE
    last_page_end = -(-written_end // PAGE_SIZE) * PAGE_SIZE
    expected_anon = min(end, last_page_end) - start  # bytes of the tensor on the written pages
    assert first_page <= start
    result = _classify(big)
    assert result.anonymous == expected_anon, (result, expected_anon)
    assert result.file_backed == big.nbytes - expected_anon
    # The neighbouring tensor on the same file was never written: it stays file-backed.
    with safe_open(path, "pt") as handle:
        small = handle.get_tensor("small")
    float(small.sum())
    assert _classify(small).anonymous == 0


def test_torch_empty_filled_is_anonymous():
    t = torch.empty(8 * MiB, dtype=torch.uint8).fill_(1)
    result = _classify(t)
    assert result.anonymous == t.nbytes
    assert result.file_backed == result.shmem == result.pinned == 0


def test_untouched_allocation_is_not_resident():
    # a mapping of its own, never touched (an allocator may reuse what another test left resident)
    area = mmap.mmap(-1, 64 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        t = torch.frombuffer(area, dtype=torch.uint8)
        result = _classify(t)
        assert result.not_resident >= t.nbytes - 2 * PAGE_SIZE
        assert result.anonymous <= 2 * PAGE_SIZE
        del t
    finally:
        area.close()


def test_mlocked_tensor_is_pinned():
    libc = ctypes.CDLL(None, use_errno=True)
    t = torch.empty(4 * MiB, dtype=torch.uint8).fill_(1)
    start, end = _range(t)
    aligned = start // PAGE_SIZE * PAGE_SIZE
    length = end - aligned
    if libc.mlock(ctypes.c_void_p(aligned), ctypes.c_size_t(length)) != 0:
        pytest.skip(f"mlock refused: {os.strerror(ctypes.get_errno())}")
    try:
        result = _classify(t)
        assert result.pinned == t.nbytes, result
        assert result.anonymous == 0
    finally:
        libc.munlock(ctypes.c_void_p(aligned), ctypes.c_size_t(length))
    assert _classify(t).anonymous == t.nbytes


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this machine")
@pytest.mark.parametrize("loader", ["readonly", "safe_open"])
def test_file_on_tmpfs_is_shmem_not_file_backed(loader):
    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        path = write_safetensors(os.path.join(folder, "w.safetensors"), {"w": torch.randn(512, 1024)})
        if loader == "readonly":
            w = load_readonly(path)["w"]
        else:
            with safe_open(path, "pt") as handle:
                w = handle.get_tensor("w")
        float(w.sum())
        result = _classify(w)
        assert result.shmem == w.nbytes, result
        assert result.file_backed == 0 and result.anonymous == 0


def test_tied_weights_are_counted_once():
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(256, 512)
    model.head = torch.nn.Linear(512, 256, bias=False)
    model.head.weight = model.embed.weight
    ledger = account(model)
    params = ledger.components["model"].parameters
    assert list(params) == ["embed.weight"]
    assert params["embed.weight"].shared_with == ("head.weight",)
    assert ledger.totals.anonymous == 256 * 512 * 4


def test_a_write_into_the_readonly_mapping_faults_instead_of_copying(tmp_path):
    path = _weights(tmp_path)
    child = run_python(
        """
        import sys
        from hostmem import load_readonly
        w = load_readonly(sys.argv[1])["big"]
        print("before", float(w.sum()), flush=True)
        w.add_(1.0)
        print("wrote", flush=True)
        """,
        path,
    )
    assert "before" in child.stdout
    assert "wrote" not in child.stdout
    assert child.returncode in (-signal.SIGSEGV, -signal.SIGBUS), child


def test_pinned_heap_pages_are_explained_not_unattributed():
    libc = ctypes.CDLL(None, use_errno=True)
    module = torch.nn.Module()
    module.register_buffer("staging", torch.empty(32 * MiB, dtype=torch.uint8).fill_(1))
    start, end = _range(module.staging)
    before = account(module)
    aligned = start // PAGE_SIZE * PAGE_SIZE
    if libc.mlock(ctypes.c_void_p(aligned), ctypes.c_size_t(end - aligned)) != 0:
        pytest.skip(f"mlock refused: {os.strerror(ctypes.get_errno())}")
    try:
        after = account(module)
    finally:
        libc.munlock(ctypes.c_void_p(aligned), ctypes.c_size_t(end - aligned))
    assert after.totals.pinned == after.totals.pinned_anonymous == 32 * MiB
    assert after.totals.anonymous == 0
    # Still in RssAnon, but explained by the pinned parameter: not counted twice.
    assert abs(after.unattributed_anonymous - before.unattributed_anonymous) < 8 * MiB


def test_an_area_without_access_rights_is_not_resident_and_costs_no_page_walk():
    import mmap

    MAP_NORESERVE = 0x4000  # Linux; a reservation as allocators and sanitizers make them
    reservation = mmap.mmap(-1, 64 * 1024**3, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE, prot=0)
    from hostmem.residency import RangeClassifier

    def bytes_read() -> int:  # every read syscall of this process, pagemap included
        with open("/proc/self/io") as handle:
            return next(int(line.split()[1]) for line in handle if line.startswith("rchar:"))

    with RangeClassifier() as classifier:
        areas = [v for v in classifier.vmas if v.perms.startswith("---") and v.size == 64 * 1024**3]
        assert areas, "the reservation is not in /proc/self/maps"
        before = bytes_read()
        result = classifier.classify_area(areas[0])
        read = bytes_read() - before
    assert result.not_resident == 64 * 1024**3 and result.resident == 0
    assert read < 1 * MiB  # its 16 Mi pagemap entries (128 MiB) were never read
    reservation.close()


def test_ranges_across_chunk_boundaries_add_up(monkeypatch):
    import hostmem.residency as residency

    import mmap

    fresh = mmap.mmap(-1, 16 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # untouched pages
    t = torch.frombuffer(fresh, dtype=torch.uint8)
    t[: 5 * MiB].fill_(1)  # the rest is never touched
    start = t.data_ptr() + 123  # not page-aligned on purpose
    ranges = [(start, start + 3 * MiB + 7), (start + 3 * MiB + 7, start + 9 * MiB), (start + 9 * MiB, start + 15 * MiB)]
    whole = residency.RangeClassifier().classify_many(ranges)
    monkeypatch.setattr(residency, "_CHUNK_PAGES", 97)  # many chunk edges inside each range
    chunked = residency.RangeClassifier().classify_many(ranges)
    assert chunked == whole
    assert sum(r.total for r in chunked) == 15 * MiB
    touched = sum(r.anonymous for r in chunked)  # the filled 5 MiB, to the end of its last page
    assert 5 * MiB - 123 <= touched < 5 * MiB - 123 + PAGE_SIZE


def test_private_memfd_and_dev_zero_mappings_count_copied_pages_as_anonymous():
    """A private mapping of a memfd is a private tmpfs file's (its pages shmem until a write
    copies them); one of /dev/zero is anonymous memory. Only a shared one is shmem throughout."""
    pages = 256
    fd = os.memfd_create("hostmem-test")
    try:
        os.ftruncate(fd, pages * PAGE_SIZE)
        os.write(fd, b"a" * pages * PAGE_SIZE)
        area = mmap.mmap(fd, pages * PAGE_SIZE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    zero_fd = os.open("/dev/zero", os.O_RDWR)
    try:
        zero = mmap.mmap(zero_fd, pages * PAGE_SIZE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(zero_fd)
    try:
        start = ctypes.addressof(ctypes.c_char.from_buffer(area))
        sum(area[i * PAGE_SIZE] for i in range(pages))  # every page read: the file's
        area[: pages * PAGE_SIZE // 2] = b"b" * (pages * PAGE_SIZE // 2)  # half written: copies
        found = classify_range(start, start + pages * PAGE_SIZE)
        assert (found.anonymous, found.shmem) == (pages * PAGE_SIZE // 2, pages * PAGE_SIZE // 2)
        zero[:] = b"z" * (pages * PAGE_SIZE)
        start = ctypes.addressof(ctypes.c_char.from_buffer(zero))
        found = classify_range(start, start + pages * PAGE_SIZE)
        assert (found.anonymous, found.shmem) == (pages * PAGE_SIZE, 0)
    finally:
        import gc

        gc.collect()
        area.close()
        zero.close()


def _scan_supported() -> bool:
    from hostmem.pagemap import SCAN_PFNZERO, PagemapReader

    with PagemapReader() as reader:
        return reader.scan(0, PAGE_SIZE, SCAN_PFNZERO) is not None


@pytest.mark.skipif(not _scan_supported(), reason="needs PAGEMAP_SCAN (Linux 6.7+) to tell zero-page reads apart")
@pytest.mark.parametrize("huge", [False, True], ids=["4KiB", "huge"])
def test_memory_only_read_maps_the_zero_page_and_is_counted_as_the_kernel_charges_it(huge):
    """A read of never-written anonymous memory (np.zeros' calloc, a fresh mmap) maps the
    shared zero page: pagemap shows it present (the huge zero page even as shared), the
    kernel charges nothing. Only the written quarter is anonymous, as smaps says."""
    from hostmem.procfs import read_smaps

    size = 8 * MiB
    area = mmap.mmap(-1, size + 2 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = ctypes.addressof(ctypes.c_char.from_buffer(area))
    start += -start % (2 * MiB)
    if huge:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(size), 14)  # MADV_HUGEPAGE
    pages = torch.frombuffer((ctypes.c_char * size).from_address(start), dtype=torch.uint8)
    assert int(pages[::PAGE_SIZE].sum()) == 0  # read every page: each maps the zero page
    pages[: size // 4] = 1
    found = classify_range(start, start + size)
    (vma,) = [v for v in read_smaps() if v.start <= start < v.end]
    assert (found.anonymous, found.not_resident, found.shmem) == (size // 4, 3 * size // 4, 0), found
    assert vma.anonymous == size // 4
    del pages
    area.close()
