"""The plan and the executor agree: one kept set, a window counted in bytes, a reader chosen once.

Real checkpoints mapped read-only or by ``safetensors.torch.load_file``, real plans
(``plan_loaded`` and declared sizes), the real ``hostmem calibrate`` record.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from hostmem.procfs import read_smaps, read_status
from planners.budget import HostLimit
from planners.cli import main
from planners.config import parse_config
from planners.deployment import plan_deployment
from planners.executor import execute, plan_roles, read_io_bytes
from planners.calibration import RECORD
from planners.executor.layout import FileRange, MapIndex, inner_pages, outer_pages
from planners.executor.readahead import DEFAULT_READER, READERS, FileHandles, drop_range, read_ahead, set_random
from planners.executor.synthetic import load_synthetic_dit, write_synthetic_dit
from planners.executor.trial import synthetic_config
from planners.report import report_dict, report_text
from planners.sizes import from_declared
from planners.startup import plan_loaded
from planners.whatif import predict

from .conftest import MiB

LAYERS = 16  # of 1 MiB (512 x 512 fp32)


@pytest.fixture
def model(tmp_path):
    path = write_synthetic_dit(tmp_path / "dit.safetensors", LAYERS, 512, torch.float32)
    return path, load_synthetic_dit(path)


@pytest.fixture
def root(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("HOSTMEM_CACHE_ROOT", str(folder))
    return folder


def _plan(checkpoint, model, room, max_pinned=0):
    reserve = read_status().rss_anon + 256 * MiB
    config = synthetic_config(os.fspath(checkpoint), reserve + room, reserve, max_pinned, 3)
    return plan_loaded(config, {"dit": model})


def test_the_plans_kept_set_is_the_executors_layer_for_layer(model, root):
    path, dit = model
    plan = _plan(path, dit, room=8 * MiB)
    planned = plan.pins.plans["dit"].kept_layers
    assert planned and len(planned) < LAYERS and plan.pins.prefetch == 1  # the config's default prefetch
    with execute(plan, {"dit": dit}) as run:  # no prefetch given: the plan's
        assert run.roles["dit"].kept == planned
        assert run.stats().roles["dit"]["kept"] == len(planned)
    text = report_text(plan)
    assert f"the executor keeps {len(planned)} of {LAYERS} in page cache" in text
    assert report_dict(plan)["pin_plans"]["dit"]["kept_layers"] == list(planned)
    # a prefetch other than the plan's is another window, and may keep another set: the
    # default is what makes them one
    assert plan_roles(plan, 1)["dit"].kept == planned


def test_pins_at_75_percent_leave_the_window_and_the_executor_reads_what_the_plan_says(model, root):
    path, dit = model
    plan = _plan(path, dit, room=8 * MiB, max_pinned="75%")
    pins, roles = plan.pins, plan_roles(plan, plan.pins.prefetch)["dit"]
    assert pins.pinned_bytes > 0 and roles.released  # pins took what they could, the rest streams
    assert pins.room_after_pins >= pins.window_bytes > 0  # ...but not the window's room
    assert roles.kept_bytes + pins.window_bytes <= pins.room_after_pins + MiB  # kept + window fit the room


GiB_RESERVE = 1 << 30


def _declared(room: int, layers: int, layer: int, prefetch: int):
    text = (f"deployment: large-layers\nhost: {{limit: {GiB_RESERVE + room}B, reserve: {GiB_RESERVE}B, "
            "max_pinned: 0B}\nworkload: {steps: 2}\ncomponents:\n"
            f"  dit: {{size: {layers * layer}B, layers: {layers}, offload: layerwise, prefetch: {prefetch}}}\n")
    config = parse_config(text, "large.yaml", environ={})
    c = config.components["dit"]
    sizes = {"dit": predict(from_declared("dit", c.offload, c.size, c.layer_count), c.load)}
    return plan_deployment(config, sizes, HostLimit(config.host.limit, "config", 64 << 30, None))


def test_a_few_large_layers_keep_what_fits_beside_a_window_counted_in_bytes():
    # 8 layers of 8 MiB (the 8 of 256 MiB, at MiB scale), prefetch 2, 24 MiB of room:
    # counted in layers the window would be 3 layers, the whole room, and keep nothing.
    plan = _declared(24 * MiB, 8, 8 * MiB, prefetch=2)
    roles = plan_roles(plan, 2)["dit"]
    # the layer computing and one read ahead: two would be more than a sixteenth of the stream
    assert roles.read_ahead_bytes == 8 * MiB
    assert len(roles.kept) == 1 and len(roles.released) == 7
    assert roles.predicted_read_bytes == 7 * 8 * MiB
    assert plan.pins.plans["dit"].kept_layers == roles.kept
    # small layers keep their prefetch: 64 layers of 1 MiB read 2 ahead
    small = plan_roles(_declared(24 * MiB, 64, MiB, prefetch=2), 2)["dit"]
    assert small.read_ahead_bytes == 2 * MiB and len(small.kept) == 64 - len(small.released) == 21


def test_the_executor_reads_ahead_no_further_than_the_plans_window(tmp_path, root):
    path = write_synthetic_dit(tmp_path / "large.safetensors", 8, 1024, torch.float32)  # 8 layers of 4 MiB
    dit = load_synthetic_dit(path)
    plan = _plan(path, dit, room=12 * MiB)
    with execute(plan, {"dit": dit}, prefetch=3) as run:
        roles, pipe = run.roles["dit"], run.pipelines["dit"]
        assert roles.read_ahead_bytes == 4 * MiB  # one layer: a sixteenth of 32 MiB is less
        held = []

        def measure(module, args, name):
            held.append(sum(pipe.layouts[n].mapped_bytes for n in pipe.pending if n in roles.released))

        hooks = [dit.get_submodule(n).register_forward_pre_hook(lambda m, a, n=n: measure(m, a, n))
                 for n in roles.released]
        with torch.no_grad():
            for _ in range(2):
                dit(torch.randn(2, 64))
        for h in hooks:
            h.remove()
    assert held and max(held) <= roles.read_ahead_bytes  # never more ahead than the plan made room for


def test_auto_reads_the_calibration_record_once_and_chooses_alike_at_no_cost(model, tmp_path, root, capsys):
    path, dit = model
    plan = _plan(path, dit, room=8 * MiB)
    drop_range_file(path)
    chosen = []
    for _ in range(2):
        before = read_io_bytes()
        with execute(plan, {"dit": dit}) as run:
            started = read_io_bytes() - before
            chosen.append(run.stats().reader)
        assert started == 0  # nothing timed at start: no layer read to choose a reader
    assert chosen == [DEFAULT_READER, DEFAULT_READER]
    folder = tmp_path / "disk"
    folder.mkdir()
    assert main(["calibrate", "--path", str(folder), "--root", str(root), "--size", "8MiB", "--save", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    saved = json.loads((root / RECORD).read_text())["read_ahead"]
    assert saved == result["read_ahead"] and saved["reader"] in READERS and set(saved["seconds"]) == set(READERS)
    for _ in range(2):
        with execute(plan, {"dit": dit}) as run:
            assert run.stats().reader == saved["reader"]
    with execute(plan, {"dit": dit}, read_ahead="read") as run:  # a reader named is the one used
        assert run.stats().reader == "read"


def _flags_over(start: int, end: int) -> list[frozenset]:
    """VmFlags of every area of this process that overlaps ``[start, end)``; the areas must cover it."""
    areas = sorted((v for v in read_smaps() if v.start < end and v.end > start), key=lambda v: v.start)
    at = start
    for vma in areas:
        assert vma.start <= at, f"no area maps {at:#x}"
        at = vma.end
    assert at >= end, f"no area maps {at:#x}"
    return [vma.vm_flags for vma in areas]


@pytest.mark.parametrize("address, length", [(3 * 4096 + 5, 10), (2 * 4096, 4096), (2 * 4096, 4096 + 1),
                                             (3 * 4096 - 1, 2), (3 * 4096 + 5, 0)])
def test_a_ranges_outer_pages_hold_it_and_its_inner_pages(address, length):
    r = FileRange("dit.safetensors", 0, length, address, False)
    outer, outer_len = outer_pages(r)
    inner, inner_len = inner_pages(r)
    assert outer % 4096 == 0 and outer_len % 4096 == 0
    if length:
        assert outer <= address and address + length <= outer + outer_len < address + length + 4096
        assert outer_len == 4096 * (-(-(address + length) // 4096) - address // 4096)
    else:
        assert outer_len == 0
    assert not inner_len or outer <= inner and inner + inner_len <= outer + outer_len


@pytest.mark.parametrize("loader", ["safetensors", "hostmem"])
def test_the_advice_covers_a_layers_partial_pages_at_its_ends(tmp_path, loader):
    """A layer starts and ends mid-page (the file's header is not page-sized): a fault in such a
    page, left without ``MADV_HUGEPAGE`` and ``MADV_RANDOM``, reads around it (``read_ahead_kb``,
    8 MiB on a virtual disk) in 4 KiB folios, into the layers beside it; on safetensors' private
    mapping that cost a third of every pass. Every page a layer touches gets both advices."""
    path = write_synthetic_dit(tmp_path / "dit.safetensors", 3, 512, torch.float32)
    dit = load_synthetic_dit(path, loader)
    weight = dit.blocks[1].proj.weight
    layer = MapIndex().find(weight.data_ptr(), weight.numel() * weight.element_size())
    start, length = outer_pages(layer)
    assert layer.address % 4096 and (layer.address, layer.length) != (start, length)  # it has partial pages
    set_random([layer], True)
    try:
        assert all({"hg", "rr"} <= flags for flags in _flags_over(start, start + length))
    finally:
        set_random([layer], False)
    assert not any("rr" in flags for flags in _flags_over(start, start + length))


def drop_range_file(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _major_faults() -> int:
    with open("/proc/self/stat") as handle:
        return int(handle.read().rsplit(")", 1)[1].split()[9])


@pytest.mark.parametrize("loader", ["safetensors", "hostmem"])
def test_the_readers_read_a_load_file_mapping_in_large_pieces(tmp_path, loader):
    """``safetensors.torch.load_file`` maps privately, in 4 KiB pages: advised as the executor
    does, a layer of 16 MiB comes in with a few faults of 2 MiB folios, not 4096 of 4 KiB."""
    path = write_synthetic_dit(tmp_path / "dit.safetensors", 2, 2048, torch.float32)  # blocks of 16 MiB
    dit = load_synthetic_dit(path, loader)
    weight = dit.blocks[1].proj.weight
    layer = MapIndex().find(weight.data_ptr(), weight.numel() * weight.element_size())
    assert layer.private == (loader == "safetensors")  # load_file's mapping is private (and writable)
    handles = FileHandles()
    set_random([layer], True)
    try:
        for how in ("parallel", "fault"):
            drop_range(layer, handles)
            drop_range_file(path)
            faults, before = _major_faults(), read_io_bytes()
            read_ahead([layer], handles, how)
            assert read_io_bytes() - before >= layer.length - 4 * 2 * MiB  # from disk: it was dropped
            assert _major_faults() - faults < 64, how  # 2 MiB per fault (4 KiB would be 4096)
    finally:
        set_random([layer], False)
        handles.close()
