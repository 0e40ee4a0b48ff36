"""planners.execute in this process: roles from the plan, pins, hooks, release, and a clean exit."""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest
import torch

from hostmem.procfs import PAGE_SIZE, read_status
from hostmem.residency import classify_range
from planners.executor import disk_tier, execute, plan_roles, read_io_bytes
from planners.executor.layout import MapIndex
from planners.executor.readahead import FileHandles, drop_range, read_ahead, uncache_ranges
from planners.executor.synthetic import load_synthetic_dit, write_synthetic_dit
from planners.executor.trial import synthetic_config
from planners.sizes import REST
from planners.startup import plan_loaded

from tests.page_cache import cached_pages

from .conftest import MiB
from .test_pin_apply import require_mlock

LAYERS = 16  # of 1 MiB (512 x 512 fp32)


def _plan(checkpoint, model, room, max_pinned=0, steps=3):
    reserve = read_status().rss_anon + 256 * MiB  # this process's own memory, with room to spare
    config = synthetic_config(os.fspath(checkpoint), reserve + room, reserve, max_pinned, steps)
    return plan_loaded(config, {"dit": model})


@pytest.fixture
def model(tmp_path):
    path = write_synthetic_dit(tmp_path / "dit.safetensors", LAYERS, 512, torch.float32)
    return path, load_synthetic_dit(path)


def _hooks(module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())


def test_roles_cover_every_layer_once_and_keep_a_spread_set_that_fits(model):
    path, dit = model
    plan = _plan(path, dit, room=8 * MiB)
    roles = plan_roles(plan, prefetch=2)["dit"]
    everyone = roles.pinned + roles.kept + roles.released
    assert sorted(everyone) == sorted(roles.order) and len(set(everyone)) == LAYERS
    assert not plan.pins.plans["dit"].page_cache_fits
    layer = MiB
    assert 0 < len(roles.kept) and roles.kept_bytes <= plan.pins.room_after_pins - 3 * layer + layer
    assert roles.predicted_read_bytes == len(roles.released) * layer
    positions = sorted(roles.order.index(k) for k in roles.kept)
    assert positions[-1] - positions[0] > len(positions)  # spread over the pass, not its first layers
    roomy = plan_roles(_plan(path, dit, room=64 * MiB), prefetch=2)["dit"]
    assert not roomy.released and roomy.predicted_read_bytes == 0
    (nbytes, seconds), = disk_tier(plan, prefetch=2, disk_read=1e9).values()
    assert nbytes == 3 * roles.predicted_read_bytes and seconds == nbytes / 1e9  # 3 steps
    # the plan's own figure is the executor's at the plan's prefetch (1), not the kernel's LRU (every layer)
    (planned, _), = disk_tier(plan, prefetch=1, disk_read=1e9).values()
    assert plan.pins.plans["dit"].disk_bytes_per_request == planned < 3 * plan.pins.plans["dit"].page_cache_bytes


def test_pins_hooks_and_release_are_all_undone_on_exit(model):
    path, dit = model
    plan = _plan(path, dit, room=8 * MiB, max_pinned=2 * MiB)
    pinned = plan.pins.plans["dit"].pinned_layers
    assert pinned, plan.pins
    require_mlock(4 * MiB)
    x = torch.randn(4, 64)
    with torch.no_grad():
        reference = dit(x)
    vm_before = read_status().vm_lck
    with torch.no_grad(), execute(plan, {"dit": dit}, read_ahead="madvise") as run:
        assert read_status().vm_lck - vm_before >= len(pinned) * MiB
        assert _hooks(dit) == 2 + 2 * LAYERS
        outs = [dit(x) for _ in range(3)]
        stats = run.stats()
    assert read_status().vm_lck == vm_before and _hooks(dit) == 0
    assert all(torch.equal(out, reference) for out in outs)
    assert [p.index for p in stats.passes] == [0, 1, 2] and stats.reader == "madvise"
    roles = stats.roles["dit"]
    assert roles["pinned"] == len(pinned) and roles["released"] > 0
    for one in stats.passes:
        assert one.read_ahead_bytes >= one.predicted_read_bytes > 0 and one.copied_bytes == 0
        assert one.released_bytes > one.predicted_read_bytes - roles["released"] * 2 * PAGE_SIZE
    assert stats.to_dict()["passes"][0]["component"] == "dit"


def test_a_plan_of_other_weights_or_a_flat_module_is_refused(model, tmp_path):
    path, dit = model
    other = write_synthetic_dit(tmp_path / "other.safetensors", LAYERS, 256, torch.float32)
    plan = _plan(other, load_synthetic_dit(other), room=2 * MiB)
    with pytest.raises(ValueError, match="plan again after loading"):
        execute(plan, {"dit": dit}).__enter__()
    assert _hooks(dit) == 0
    with pytest.raises(ValueError, match="no module of that name"):
        execute(plan, {"transformer": dit}).__enter__()
    with pytest.raises(ValueError, match="has no submodule of that name"):
        execute(plan, {"dit": torch.nn.Sequential()}).__enter__()
    with pytest.raises(ValueError, match="choose auto"):
        execute(plan, {"dit": load_synthetic_dit(other)}, read_ahead="fast").__enter__()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_asking_for_a_cuda_device_without_one_is_a_clear_refusal(model):
    path, dit = model
    with pytest.raises(ValueError, match="no CUDA device"):
        execute(_plan(path, dit, room=MiB), {"dit": dit}, device="cuda:0")


def test_the_device_paths_cpu_twin_copies_every_moved_layer_and_puts_the_weights_back(model):
    """The CUDA path (buffer pool, staging, parameter swap) with device="cpu": synchronous copies."""
    path, dit = model
    plan = _plan(path, dit, room=8 * MiB, max_pinned=2 * MiB)
    require_mlock(4 * MiB)
    x = torch.randn(4, 64)
    weights = [p for p in dit.parameters()]
    mapped = dit.blocks[3].proj.weight.data_ptr()
    with torch.no_grad():
        reference = dit(x)
        with execute(plan, {"dit": dit}, device="cpu", prefetch=2) as run:
            seen = []
            hook = dit.blocks[3].register_forward_pre_hook(lambda m, a: seen.append(m.proj.weight.data_ptr()))
            outs = [dit(x) for _ in range(3)]
            hook.remove()
            stats = run.stats()
    assert all(torch.equal(out, reference) for out in outs)
    assert len(seen) == 3 and mapped not in seen  # computed from a pool buffer, not the mapping
    assert all(a is b for a, b in zip(dit.parameters(), weights)) and _hooks(dit) == 0
    moved = sum(stats.roles["dit"][k] for k in ("pinned", "kept", "released"))
    assert moved == LAYERS and all(p.copied_bytes == LAYERS * MiB for p in stats.passes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA copies need a CUDA device")
def test_on_a_cuda_host_streamed_layers_compute_on_the_device(model):
    path, dit = model
    plan = _plan(path, dit, room=8 * MiB)
    x = torch.randn(4, 64)
    with torch.no_grad():
        reference = dit(x)
        with execute(plan, {"dit": dit}, device="cuda:0") as run:
            out = dit(x.cuda())
        assert run.stats().passes[0].copied_bytes > 0
    torch.testing.assert_close(out.cpu(), reference, rtol=1e-4, atol=1e-4)
    assert all(p.device.type == "cpu" for p in dit.parameters())


def test_parallel_reader_brings_a_layer_in_from_several_threads_and_closes_them(tmp_path):
    import threading

    path = write_synthetic_dit(tmp_path / "dit.safetensors", 2, 2048, torch.float32)  # blocks of 16 MiB
    dit = load_synthetic_dit(path)
    weight = dit.blocks[1].proj.weight
    layer = MapIndex().find(weight.data_ptr(), weight.numel() * weight.element_size())
    handles = FileHandles()
    try:
        drop_range(layer, handles)
        before = read_io_bytes()
        assert read_ahead([layer], handles, "parallel") == layer.length
        first = read_io_bytes() - before
        assert first >= layer.length - 4 * PAGE_SIZE  # read from disk: the pages were dropped
        readers = [t for t in threading.enumerate() if t.name.startswith("hostmem-fault")]
        assert len(readers) > 1  # pieces read at once, not one after another
        before = read_io_bytes()
        read_ahead([layer], handles, "parallel")
        assert read_io_bytes() - before < layer.length // 8  # now in page cache: nothing read again
    finally:
        handles.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("hostmem-fault")]


@pytest.mark.parametrize("later", [False, True], ids=["whole", "page-cache-later"])
@pytest.mark.parametrize("protected", [False, True], ids=["writable", "made-read-only-after"])
def test_release_of_a_private_mapping_keeps_a_written_page(tmp_path, protected, later):
    """MADV_DONTNEED would revert a copied-on-write page to the file; the release must not,
    also where the mapping was made read-only after the write (mprotect: the copy stays), and
    also where the page cache's half is left for another thread (the executor's worker)."""
    path = tmp_path / "w.bin"
    path.write_bytes(b"\0" * (8 * PAGE_SIZE))
    with open(path, "r+b") as handle:
        area = mmap.mmap(handle.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        area[3 * PAGE_SIZE] = 7  # this page is anonymous now
        address = ctypes.addressof(ctypes.c_char.from_buffer(area))
        if protected:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            assert libc.mprotect(address, 8 * PAGE_SIZE, mmap.PROT_READ) == 0, ctypes.get_errno()
        found = MapIndex().find(address, 8 * PAGE_SIZE)
        assert found is not None and found.private
        handles, uncache = FileHandles(), [] if later else None
        try:
            assert drop_range(found, handles, uncache=uncache) == 8 * PAGE_SIZE
            uncache_ranges(uncache or [])
        finally:
            handles.close()
        assert area[3 * PAGE_SIZE] == 7 and area[0] == 0
    finally:
        area.close()


def test_a_private_mappings_page_cache_half_of_a_release_waits_for_uncache(tmp_path):
    """With ``uncache``, drop_range unmaps the pages from this process now (what must happen in
    the layer's own thread) and leaves the file's pages in the page cache until
    ``uncache_ranges`` drops them, on whatever thread runs it."""
    path = tmp_path / "w.bin"
    path.write_bytes(os.urandom(8 * PAGE_SIZE))
    with open(path, "r+b") as handle:
        os.fsync(handle.fileno())  # clean pages: a dirty one stays in the page cache until written
        area = mmap.mmap(handle.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        expected = bytes(area)  # every page read: mapped, and in the page cache
        address = ctypes.addressof(ctypes.c_char.from_buffer(area))
        found = MapIndex().find(address, 8 * PAGE_SIZE)
        assert classify_range(address, address + 8 * PAGE_SIZE).file_backed == 8 * PAGE_SIZE
        handles, uncache = FileHandles(), []
        try:
            assert drop_range(found, handles, uncache=uncache) == 8 * PAGE_SIZE
            assert classify_range(address, address + 8 * PAGE_SIZE).not_resident == 8 * PAGE_SIZE
            assert all(cached_pages(str(path))) and uncache
            uncache_ranges(uncache)
        finally:
            handles.close()
        assert not any(cached_pages(str(path)))
        assert bytes(area) == expected  # read again from the file
    finally:
        area.close()


def test_the_rest_of_a_component_is_never_released(model):
    path, dit = model
    roles = plan_roles(_plan(path, dit, room=4 * MiB), prefetch=1)["dit"]
    assert REST not in roles.released + roles.kept and REST not in roles.order
