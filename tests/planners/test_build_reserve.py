"""A combination built in the background holds its working set back from the host budget.

``lora_cache.set_adapters`` serves a combination the vault lacks at run time and builds
it in the background; until the swap, that build may still allocate one layer's output
and its fp32 sum. The pins planned meanwhile must leave that free, and the report says
what is held back and why; with no build pending the term is 0 and the line is absent.
"""

from __future__ import annotations

import os
import re

import pytest

import lora_cache
from hostmem.residency_classes import Residency
from hostmem.units import format_size
from lora_cache.switching.adapter_switch import build_reserve_bytes, serving
from planners.budget import host_budget
from planners.config import load_config
from planners.host_share import RankNeed, host_budget_of
from planners.report import report_dict, report_text
from planners.startup import pending_build_reserve, plan_loaded
from tests.lora_cache.switching.test_adapter_switch import held_builder  # noqa: F401  (a fixture)
from tests.lora_cache.switching.test_runtime_lora import stack_adapter, stack_model

from .conftest import MiB, pins_config

# Eight fp32 layers of 1 MiB (and a bias) streamed; 9 MiB of room above the reserve, so
# every layer is pinned when nothing is being built, and fewer while a build is pending.
DIM, DEPTH = 512, 8
CONFIG = pins_config("build-reserve", "2057MiB", "2GiB", dit_layers="layers.{i}.", text_encoder=False)
LINE = "- pending adapter builds"  # the budget row; its reason follows the budget table


@pytest.fixture
def switching(tmp_path):
    """A mapped model, an adapter for it, its config, and the vault root to switch through."""
    os.makedirs(tmp_path / "dit")
    model = stack_model(tmp_path / "dit", DIM, DEPTH)
    adapter = stack_adapter(tmp_path / "a.safetensors", DIM, DEPTH, 1)
    (tmp_path / "deploy.yaml").write_text(CONFIG.lstrip())
    config = load_config(tmp_path / "deploy.yaml", environ={})
    return model, adapter, config, str(tmp_path / "root")


def _free_after_pins(plan) -> int:
    """What the plan leaves of the limit once the reserve, committed memory and its pins are paid."""
    b = plan.budget
    return b.limit - b.reserve - b.committed - plan.pins.net_cost_bytes


def test_pins_planned_while_a_build_is_pending_leave_its_reserve_free(switching, held_builder):  # noqa: F811
    model, adapter, config, root = switching
    before = plan_loaded(config, {"dit": model})
    assert before.budget.build_reserve == 0 and report_dict(before)["budget"]["build_reserve_bytes"] == 0
    assert "pending adapter builds" not in report_text(before)  # neither the row nor its reason

    assert lora_cache.set_adapters(model, [adapter], cache_root=root).mode == "runtime"
    reserve = build_reserve_bytes(model)
    layer = model.layers[0].weight
    assert reserve == layer.nbytes + 4 * layer.numel() > 0  # the build has not started: held by the fixture
    pending = plan_loaded(config, {"dit": model})
    assert pending.budget.build_reserve == reserve
    assert pending.budget.room == before.budget.room - reserve
    assert _free_after_pins(pending) >= reserve
    assert pending.pins.pinned_bytes < before.pins.pinned_bytes  # the term changed the plan, not only the report
    assert report_dict(pending)["budget"]["build_reserve_bytes"] == reserve
    text = report_text(pending)
    assert re.search(rf"^\s*{re.escape(LINE)}\s+{re.escape(format_size(reserve))}\s+\(see below\)$", text, re.M)
    assert f"held back {format_size(reserve)} for pending adapter builds: a combination served at run time " \
           "is being merged in the background" in text

    held_builder.set()
    assert lora_cache.swap_ready(model, wait=True, timeout=60) and serving(model) == "merged"
    after = plan_loaded(config, {"dit": model})
    assert after.budget.build_reserve == 0 and report_dict(after)["budget"]["build_reserve_bytes"] == 0
    assert "pending adapter builds" not in report_text(after)
    assert after.pins.pinned_bytes == before.pins.pinned_bytes


def test_the_process_builds_one_combination_at_a_time_so_components_hold_back_the_largest(
        tmp_path, held_builder):  # noqa: F811
    """Two models switched apart queue two builds on the one build thread: the reserve is
    the larger build's, not the sum."""
    models = {}
    for name, dim in (("small", 128), ("large", 256)):
        os.makedirs(tmp_path / name)
        models[name] = stack_model(tmp_path / name, dim, 2)
        adapter = stack_adapter(tmp_path / f"{name}.safetensors", dim, 2, 1)
        assert lora_cache.set_adapters(models[name], [adapter], cache_root=str(tmp_path / "root")).mode == "runtime"
    reserves = {name: build_reserve_bytes(m) for name, m in models.items()}
    assert 0 < reserves["small"] < reserves["large"]
    assert pending_build_reserve(models) == reserves["large"]
    held_builder.set()
    for model in models.values():
        assert lora_cache.swap_ready(model, wait=True, timeout=60)
    assert pending_build_reserve(models) == 0


def test_the_build_reserve_is_a_term_of_the_budget():
    GiB = 1024 * MiB
    committed = Residency(anonymous=3 * GiB)
    plain = host_budget(32 * GiB, 4 * GiB, 24 * GiB, committed)
    held = host_budget(32 * GiB, 4 * GiB, 24 * GiB, committed, build_reserve=GiB)
    assert plain.build_reserve == 0 and held.build_reserve == GiB
    assert held.committed == plain.committed  # held back, not committed
    assert (plain.room, held.room, held.bytes) == (25 * GiB, 24 * GiB, 24 * GiB)
    assert host_budget(5 * GiB, 4 * GiB, 24 * GiB, committed, build_reserve=GiB).room == 0  # floored
    with pytest.raises(ValueError, match="build_reserve -1 must not be negative"):
        host_budget(32 * GiB, 4 * GiB, 24 * GiB, committed, build_reserve=-1)


def test_every_local_rank_holds_its_build_reserve_back_from_the_host_budget(tmp_path):
    os.makedirs(tmp_path / "dit")
    (tmp_path / "deploy.yaml").write_text(CONFIG.lstrip())
    config = load_config(tmp_path / "deploy.yaml", environ={})
    idle = RankNeed(8 * MiB, Residency())
    building = RankNeed(8 * MiB, Residency(), build_reserve=MiB)
    limit = 4 * 1024 * MiB + 64 * MiB  # two reserves of 2 GiB and 64 MiB of room
    assert host_budget_of(config, limit, [idle, idle]) == 64 * MiB
    assert host_budget_of(config, limit, [idle, building]) == 63 * MiB
    assert host_budget_of(config, limit, [building, building]) == 62 * MiB
