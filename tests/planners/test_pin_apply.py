"""Applying a pin plan on a CPU host mlocks exactly the planned bytes (VmLck, smaps, accountant)."""

from __future__ import annotations

import ctypes
import mmap
import os
import resource
import shutil
import subprocess
import sys

import pytest
import torch

import hostmem
from hostmem.pinning import MlockBackend, PinError, Pinner, page_span
from hostmem.procfs import PAGE_SIZE, read_smaps, read_status
from hostmem.units import format_size
from planners.pin_apply import PinMismatch, apply_pin_plan, layer_tensors
from planners.sizes import from_ledger
from planners.startup import plan_loaded

from .conftest import MiB, load_dit_and_text_encoder, pins_config

# Layers of 4 MiB + 12 bytes, so that layer boundaries fall inside pages. The host leaves
# 30 MiB of room: 5 of the 12 streamed DiT layers get pinned, the text encoder none (the
# read-ahead window's room, a layer computing and one read ahead, stays free).
CONFIG = pins_config("pin-apply", "2078MiB", "2GiB")


@pytest.fixture
def loaded(tmp_path):
    return load_dit_and_text_encoder(tmp_path, CONFIG, 4 * MiB + 12)


def _pages_of(modules, config, plan) -> int:
    """Whole pages under the planned layers, computed here from the tensors themselves."""
    spans = []
    for name, pins in plan.pins.plans.items():
        groups = layer_tensors(modules[name], config.components[name].layer_pattern)
        for layer in pins.pinned_layers:
            spans += [page_span(t) for t in groups[layer]]
    spans.sort()
    total, end = 0, 0
    for s, e in spans:
        s = max(s, end)
        if e > s:
            total, end = total + e - s, e
    return total


def require_mlock(nbytes: int) -> None:
    """Skip, saying why, when this process may not lock ``nbytes`` at once.

    Without CAP_IPC_LOCK, mlock is bounded by RLIMIT_MEMLOCK (8 MiB by default): a
    test that pins more proves nothing there but the limit, which
    tests/hostmem/test_pinning.py checks on its own.
    """
    buf = mmap.mmap(-1, nbytes)
    view = ctypes.c_char.from_buffer(buf)
    address = ctypes.addressof(view)
    try:
        MlockBackend().lock(address, nbytes)
    except PinError as exc:
        pytest.skip(f"this process may not mlock {format_size(nbytes)}: {exc}")
    else:
        MlockBackend().unlock(address, nbytes)
    finally:
        del view
        buf.close()


def test_applying_a_plan_on_the_cpu_mlocks_exactly_the_planned_bytes(loaded):
    config, modules = loaded
    plan = plan_loaded(config, modules)
    dit = plan.pins.plans["dit"]
    assert len(dit.pinned_layers) == 5 and plan.pins.plans["text_encoder"].pinned_bytes == 0
    assert plan.pins.room_after_pins >= plan.pins.window_bytes == 2 * (4 * MiB + 12)
    require_mlock(_pages_of(modules, config, plan))
    vm_before = read_status().vm_lck
    smaps_before = sum(v.locked for v in read_smaps())
    applied = apply_pin_plan(plan, modules, config, Pinner(MlockBackend()))
    try:
        pages = _pages_of(modules, config, plan)
        assert applied.locked_bytes == pages
        assert read_status().vm_lck - vm_before == pages
        assert sum(v.locked for v in read_smaps()) - smaps_before == pages
        assert 0 <= pages - dit.pinned_bytes < 2 * PAGE_SIZE  # one run of layers: two partial pages
        ledger = hostmem.account(modules)
        layers = {u.name: u for u in from_ledger(ledger.components["dit"], "layerwise", "blocks.{i}.").units}
        assert sum(layers[n].residency.pinned for n in dit.pinned_layers) == dit.pinned_bytes
        others = sum(u.residency.pinned for n, u in layers.items() if n not in dit.pinned_layers)
        assert others < 2 * PAGE_SIZE  # only what shares a boundary page with a pinned layer
        replanned = plan_loaded(config, modules)  # pinned layers are committed now, and kept
        assert replanned.pins.plans["dit"].pinned_layers == dit.pinned_layers
        assert replanned.budget.committed_pinned >= dit.pinned_bytes
    finally:
        applied.release()
    assert read_status().vm_lck == vm_before


def test_a_plan_that_does_not_fit_the_modules_pins_nothing(loaded):
    config, modules = loaded
    plan = plan_loaded(config, modules)
    other = {"dit": mapped_module_with_fewer_layers(modules), "text_encoder": modules["text_encoder"]}
    vm_before = read_status().vm_lck
    with pytest.raises(ValueError, match="plan again"):
        apply_pin_plan(plan, other, config, Pinner(MlockBackend()))
    assert read_status().vm_lck == vm_before


def mapped_module_with_fewer_layers(modules):
    dit = modules["dit"]
    trimmed = type(dit)()
    trimmed.add_module("blocks", type(dit)())
    for name, child in dit.blocks.named_children():
        if int(name) < 4:
            trimmed.blocks.add_module(name, child)
    return trimmed


class LeakyBackend(MlockBackend):
    """A backend whose locks do not hold: it locks, then lets go at once."""

    def lock(self, start: int, length: int) -> None:
        super().lock(start, length)
        super().unlock(start, length)


def test_a_verification_failure_undoes_the_pins(loaded):
    config, modules = loaded
    plan = plan_loaded(config, modules)
    vm_before = read_status().vm_lck
    pinner = Pinner(LeakyBackend())
    with pytest.raises(PinMismatch, match=r"planned \d+ bytes pinned, the accountant finds 0"):
        apply_pin_plan(plan, modules, config, pinner)
    assert pinner.locked_bytes == 0 and read_status().vm_lck == vm_before


def _memlock_8mib() -> None:
    """In the child: the default RLIMIT_MEMLOCK of a distribution (lowering a limit needs no privilege)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = 8 * MiB if hard == resource.RLIM_INFINITY else min(hard, 8 * MiB)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit, hard))


def test_without_cap_ipc_lock_the_pin_test_skips_and_says_why(tmp_path):
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    setpriv = ["setpriv", "--bounding-set=-ipc_lock", "--inh-caps=-ipc_lock"]
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = subprocess.run(
        [*setpriv, sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         f"--basetemp={tmp_path / 'child'}", os.path.abspath(__file__), "-k", "mlocks_exactly_the_planned_bytes"],
        capture_output=True, text=True, timeout=300, cwd=repo, preexec_fn=_memlock_8mib,
    )
    if child.returncode != 0 and "setpriv" in child.stderr and "pytest" not in child.stdout:
        pytest.skip(f"setpriv cannot drop CAP_IPC_LOCK here: {child.stderr.strip()}")
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-2000:]
    summary = child.stdout.strip().splitlines()[-1]
    assert summary.startswith("1 skipped, ") and "failed" not in summary and "error" not in summary, summary
    assert "may not mlock" in child.stdout and "RLIMIT_MEMLOCK is 8.0 MiB" in child.stdout, child.stdout[-3000:]


class LettingGoBackend(MlockBackend):
    """A backend whose first lock lets the last reference to earlier pins go: what a
    server's other thread, or a garbage collection at any allocation, may do while the
    plan's pins are applied."""

    def __init__(self, earlier: list):
        super().__init__()
        self.earlier = earlier

    def lock(self, start: int, length: int) -> None:
        self.earlier.clear()  # the earlier pinner's finalizer unlocks its pages here
        super().lock(start, length)


def test_earlier_pins_let_go_while_a_plan_is_applied_are_not_the_plans_mismatch(loaded):
    """A server that pins again (a second plan, a reload) may let go of earlier pins while
    it does: VmLck then grew by less than the plan's pins, and the check called them a
    mismatch and undid them. What the kernel holds under the plan's own spans decides."""
    config, modules = loaded
    plan = plan_loaded(config, modules)
    pages = _pages_of(modules, config, plan)
    require_mlock(pages + 5 * MiB)
    earlier, tensor = Pinner(MlockBackend()), torch.ones(4 * MiB // 4)
    earlier.pin(("earlier", "0"), [tensor])
    vm_before, earlier_bytes = read_status().vm_lck, earlier.locked_bytes
    held = [earlier]
    del earlier
    applied = apply_pin_plan(plan, modules, config, Pinner(LettingGoBackend(held)))
    try:
        assert applied.locked_bytes == pages
        assert read_status().vm_lck == vm_before - earlier_bytes + pages  # the earlier pins went
        check = applied.check(modules)
        assert check.books == check.kernel == check.ledger == pages
    finally:
        applied.release()
