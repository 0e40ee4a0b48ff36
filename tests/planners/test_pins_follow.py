"""Pins follow their weights: after a remap, a merge, an unmerge and adapter switches on a
pinned model, VmLck's growth since pinning, the pinner's books and the ledger's pinned
pages are one figure, and every planned layer is still pinned (mlock on a CPU host)."""

from __future__ import annotations

import os

import pytest

import hostmem
import lora_cache
from hostmem.pinning import MlockBackend, Pinner
from hostmem.procfs import read_status
from hostmem.slots import MappedAreas
from lora_cache.placement.layers import module_tree
from planners.checkpoint import checkpoint_files
from planners.config import load_config
from planners.pin_apply import apply_pin_plan
from planners.sizes import from_ledger
from planners.startup import plan_loaded

from .conftest import MiB, mapped_module, pins_config, write_checkpoint
from .test_pin_apply import require_mlock
from .test_whatif_vs_live import write_adapter

CONFIG = pins_config("pins-follow", "2148MiB", "2GiB", text_encoder=False)


@pytest.fixture
def heap_loaded(tmp_path):
    """A DiT of 8 layers of 1 MiB loaded as a copying loader leaves it (anonymous), its
    checkpoint, and an adapter on every layer's ``w0``."""
    write_checkpoint(tmp_path / "dit", 8, MiB, cols=256)
    adapter = write_adapter(tmp_path / "style.safetensors", layers=8, rows=1024, cols=256, rank=4)
    (tmp_path / "deploy.yaml").write_text(CONFIG.lstrip())
    config = load_config(tmp_path / "deploy.yaml", environ={})
    mapped = mapped_module(tmp_path / "dit")
    dit = module_tree([(n, p.detach().clone()) for n, p in mapped.named_parameters()])
    return config, {"dit": dit}, str(tmp_path / "dit"), adapter


def _pinned_layers_whole(modules, config, layers) -> bool:
    ledger = hostmem.account(modules)
    units = {u.name: u for u in from_ledger(ledger.components["dit"], "layerwise", config.components["dit"].layer_pattern).units}
    return all(units[n].residency.pinned == units[n].nbytes for n in layers)


def test_pins_follow_a_remap_a_merge_an_unmerge_and_switches(heap_loaded, tmp_path):
    config, modules, checkpoint, adapter = heap_loaded
    dit, root = modules["dit"], str(tmp_path / "cache")
    plan = plan_loaded(config, modules)
    layers = plan.pins.plans["dit"].pinned_layers
    assert len(layers) >= 4, plan.pins
    require_mlock(16 * MiB)
    vm_before = read_status().vm_lck
    applied = apply_pin_plan(plan, modules, config, Pinner(MlockBackend()))
    steps = [
        ("remap", lambda: hostmem.remap(dit, files=checkpoint), checkpoint),
        ("merge", lambda: lora_cache.merge(dit, [(adapter, 1.0)], cache_root=root, progress=False), root),
        ("unmerge", lambda: lora_cache.unmerge(dit), checkpoint),
        ("switch", lambda: lora_cache.set_adapters(dit, [(adapter, 0.5)], root, background=False), root),
        ("switch back", lambda: lora_cache.set_adapters(dit, [(adapter, 1.0)], root, background=False), root),
        ("to the base", lambda: lora_cache.set_adapters(dit, [], root), checkpoint),
    ]
    try:
        first = applied.check(modules)
        assert first.books == first.kernel == first.ledger == read_status().vm_lck - vm_before > 0
        for step, do, served_from in steps:
            do()
            lies = MappedAreas().read_only_file(dit.get_parameter(f"blocks.{layers[0].split('.')[1]}.w0.weight"))
            assert lies is not None and lies.startswith(served_from), (step, lies)  # the weight was replaced
            check = applied.check(modules)  # raises PinMismatch where the three differ
            assert check.kernel == read_status().vm_lck - vm_before == check.ledger == check.books, (step, check)
            assert _pinned_layers_whole(modules, config, layers), step
            assert applied.released == [], step
    finally:
        applied.release()
    assert read_status().vm_lck == vm_before


def test_a_replacement_the_budget_cannot_pin_releases_the_old_pages(heap_loaded, tmp_path):
    config, modules, checkpoint, adapter = heap_loaded
    plan = plan_loaded(config, modules)
    require_mlock(16 * MiB)
    vm_before = read_status().vm_lck
    pinner = Pinner(MlockBackend(), max_locked=MiB)  # a budget that pays for about one layer
    applied = apply_pin_plan(plan, modules, config, pinner)
    try:
        assert applied.locked_now > MiB
        lora_cache.merge(modules["dit"], [(adapter, 1.0)], cache_root=tmp_path / "cache", progress=False,
                         base_files=checkpoint_files(checkpoint))
        check = applied.check(modules)
        assert check.kernel == read_status().vm_lck - vm_before == check.ledger == check.books <= MiB
        assert applied.released and set(applied.released) <= {("dit", n) for n in plan.pins.plans["dit"].pinned_layers}
    finally:
        applied.release()
    assert read_status().vm_lck == vm_before


def test_a_layer_the_plan_no_longer_pins_is_released_when_replaced(heap_loaded):
    config, modules, checkpoint, _ = heap_loaded
    plan = plan_loaded(config, modules)
    require_mlock(16 * MiB)
    vm_before = read_status().vm_lck
    dropped = plan.pins.plans["dit"].pinned_layers[0]
    pinner = Pinner(MlockBackend(), wants=lambda key: key[1] != dropped)
    applied = apply_pin_plan(plan, modules, config, pinner)
    try:
        hostmem.remap(modules["dit"], files=checkpoint)
        check = applied.check(modules)
        assert applied.released == [("dit", dropped)] and check.agree
        assert check.kernel == read_status().vm_lck - vm_before
    finally:
        applied.release()
    assert read_status().vm_lck == vm_before and os.path.exists(checkpoint)
