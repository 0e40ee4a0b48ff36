"""Layers the vault serves are read in ahead of use, in use order, where the page cache holds them.

Residency is asked of the kernel (``mincore`` on the served mapping) after each layer's
pages were dropped from the page cache (``POSIX_FADV_DONTNEED``): a build writes with
``O_DIRECT`` (nothing of it cached) and reads back what it wrote once it is sealed, a hit reads its layers
in as it maps them, and neither reads past its budget.
"""

from __future__ import annotations

import ctypes
import os
import time

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
