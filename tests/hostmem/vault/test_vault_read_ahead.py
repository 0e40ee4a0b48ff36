"""Layers the vault serves are read in ahead of use, in use order, where the page cache holds them.

Residency is asked of the kernel (``mincore`` on the served mapping) after each layer's
pages were dropped from the page cache (``POSIX_FADV_DONTNEED``): a build writes with
``O_DIRECT`` (nothing of it cached) and reads back what it wrote once it is sealed, or
writes through the page cache and reads nothing back, a hit reads its layers in as it
maps them, and none reads past its budget.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time

import pytest
import torch

from hostmem.vault import Vault
from hostmem.vault.read_ahead import ReadAhead, drain, page_cache_room
from tests.hostmem.vault.test_vault import expected_of, folder_of, key_for

MiB = 1024 * 1024
_libc = ctypes.CDLL(None, use_errno=True)


def _layers(count: int = 4) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {f"blocks.{i}.weight": torch.randn(512, 1024, generator=gen).to(torch.bfloat16) for i in range(count)}


def resident_bytes(view: torch.Tensor) -> int:
    """Bytes of ``view``'s whole pages in the page cache, as mincore reports them."""
    start = view.data_ptr() // 4096 * 4096
    length = view.data_ptr() + view.numel() * view.element_size() - start
    vector = (ctypes.c_ubyte * (-(-length // 4096)))()
    assert _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vector) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vector) * 4096


def resident_soon(views: list[torch.Tensor], expected: list[int]) -> list[int]:
    """The views' resident bytes once they are ``expected``, or after 10 s: the reads that
    read-ahead starts end when the disk is done with them."""
    assert drain()
    deadline = time.monotonic() + 10
    while (found := [resident_bytes(v) for v in views]) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return found


def _drop(folder: str) -> None:
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def test_the_room_is_memavailable_or_the_cgroup_s_tighter_room():
    with open("/proc/meminfo") as handle:
        available = next(int(line.split()[1]) * 1024 for line in handle if line.startswith("MemAvailable:"))
    room = page_cache_room()
    assert 0 < room <= available * 1.1  # MemAvailable moves between the two reads


def test_a_build_reads_back_what_it_wrote_and_a_hit_reads_in_what_it_maps(tmp_path):
    vault, key, tensors = Vault(tmp_path / "root"), key_for("ahead"), _layers()
    whole = [t.nbytes for t in tensors.values()]
    with vault.open(key, expected_of(tensors)) as session:
        views = [session.put(name, tensor) for name, tensor in tensors.items()]
        _drop(folder_of(vault, key))  # as O_DIRECT leaves them (these heap tensors are not page-aligned)
        assert drain() and [resident_bytes(v) for v in views] == [0] * len(views)  # nothing read back while it builds
    assert session.stats["read_ahead_bytes"] == sum(whole)  # read back at the close, in the model's order
    assert resident_soon(views, whole) == whole
    del views
    _drop(folder_of(vault, key))
    with vault.open(key, expected_of(tensors)) as session:
        views = [session.get(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
        assert resident_soon(views, whole) == whole
        assert all(torch.equal(v, tensors[n]) for v, n in zip(views, tensors))


def test_read_ahead_stops_at_the_first_layer_past_its_budget(tmp_path):
    vault, key, tensors = Vault(tmp_path / "root"), key_for("budget"), _layers(3)
    with vault.open(key, expected_of(tensors)) as session:
        for name, tensor in tensors.items():
            session.put(name, tensor)
    assert drain()
    _drop(folder_of(vault, key))
    layer = 512 * 1024 * 2
    with vault.open(key, expected_of(tensors)) as session:
        session._ahead = ReadAhead(budget=layer + layer // 2)  # room for one layer and a half
        views = [session.get(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
        assert session.stats["read_ahead_bytes"] == layer
    assert resident_soon(views, [layer, 0, 0]) == [layer, 0, 0]
    time.sleep(0.2)  # nothing else on its way either
    assert [resident_bytes(v) for v in views] == [layer, 0, 0]
    ahead = ReadAhead(budget=layer + layer // 2)
    assert [ahead.add(v) for v in (views[2], views[1], views[0])] == [True, False, False]  # none after the first refused
    assert ahead.bytes == layer


def _page_aligned(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies on whole pages of their own, as a build's output ring holds them, so that
    the direct way really goes around the page cache."""
    aligned = {}
    for name, tensor in tensors.items():
        buffer = mmap.mmap(-1, -(-tensor.nbytes // 4096) * 4096)
        aligned[name] = torch.frombuffer(buffer, dtype=tensor.dtype, count=tensor.numel()).view(tensor.shape)
        aligned[name].copy_(tensor)
    return aligned


def test_a_build_written_through_the_page_cache_leaves_each_layer_there_as_it_is_sealed(tmp_path):
    vault, key, tensors = Vault(tmp_path / "root"), key_for("buffered"), _page_aligned(_layers())
    whole = [t.nbytes for t in tensors.values()]
    with vault.open(key, expected_of(tensors)) as session:
        session.write_layers("buffered")
        views = [session.put(name, tensor) for name, tensor in tensors.items()]
        assert [resident_bytes(v) for v in views] == whole  # before the close: nothing to read back
        assert session.stats["read_ahead_bytes"] == sum(whole)
    assert session.stats["read_ahead_bytes"] == sum(whole)  # and the close read nothing back again
    assert all(torch.equal(v, tensors[n]) for v, n in zip(views, tensors))
    with vault.open(key, expected_of(tensors)) as session:  # sealed and verified as a direct build's layers are
        assert session.complete and all(torch.equal(session.get(n, tuple(t.shape), t.dtype), t)
                                        for n, t in tensors.items())


def test_past_the_page_cache_s_budget_a_buffered_build_writes_around_it(tmp_path):
    vault, key, tensors = Vault(tmp_path / "root"), key_for("buffered-budget"), _page_aligned(_layers(3))
    layer = 512 * 1024 * 2
    with vault.open(key, expected_of(tensors)) as session:
        session.write_layers("buffered")
        session._ahead = ReadAhead(budget=layer + layer // 2)  # room for one layer and a half
        views = [session.put(name, tensor) for name, tensor in tensors.items()]
        assert [resident_bytes(v) for v in views] == [layer, 0, 0]  # the first through the page cache only
    assert drain() and session.stats["read_ahead_bytes"] == layer  # none past the budget read back either
    time.sleep(0.2)
    assert [resident_bytes(v) for v in views] == [layer, 0, 0]
    assert all(torch.equal(v, tensors[n]) for v, n in zip(views, tensors))


def test_a_write_way_is_one_of_the_two(tmp_path):
    with Vault(tmp_path / "root").open(key_for("way"), {}) as session:
        with pytest.raises(ValueError, match="'direct' or 'buffered'"):
            session.write_layers("uncached")
