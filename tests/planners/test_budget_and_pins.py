"""The host budget, the device plan and the pin plans: pure functions over sizes."""

from __future__ import annotations

import pytest

from hostmem.residency import Residency
from planners.budget import HostLimit, host_budget, resolve_host_limit
from planners.config import load_config
from planners.deployment import plan_deployment
from planners.device_plan import plan_device
from planners.pin_plan import CostModel, MoveGroup, plan_pins
from planners.sizes import ComponentSizes, Layer, from_declared
from planners.whatif import predict

MiB, GiB = 1024**2, 1024**3

CONFIG = """
deployment: unit
host: {{limit: {limit}, reserve: 1GiB, max_pinned: {max_pinned}}}
device: {{vram: {vram}, reserve: 0}}
workload: {{steps: 4, passes_per_step: 2}}
components:
  dit: {{size: 1GiB, layers: 16, offload: layerwise, prefetch: 1}}
  text_encoder: {{size: 256MiB, layers: 4, offload: full}}
"""

COST = CostModel(pinned_h2d=24e9, pageable_h2d=8e9, disk_read=3e9)


def _config(write_config, limit="8GiB", max_pinned="100%", vram=0):
    return load_config(write_config(CONFIG.format(limit=limit, max_pinned=max_pinned, vram=vram)), environ={})


def _mapped(config, anonymous_extra: int = 0):
    comps = {
        name: predict(from_declared(name, c.offload, c.size, c.layer_count), c.load)
        for name, c in config.components.items()
    }
    if anonymous_extra:
        comps["leak"] = ComponentSizes("leak", "none", "declared", (), extra=Residency(anonymous=anonymous_extra))
    return comps


def _host(config):
    return HostLimit(config.host.limit, "config", 64 * GiB, None)


def test_the_budget_shows_each_term():
    budget = host_budget(32 * GiB, 4 * GiB, 24 * GiB, Residency(anonymous=3 * GiB, shmem=GiB, pinned=2 * GiB), GiB)
    assert budget.committed == 7 * GiB
    assert budget.room == 21 * GiB
    assert budget.pin_cap == 22 * GiB  # max_pinned less what is already pinned
    assert budget.bytes == 21 * GiB


def test_the_budget_is_capped_by_max_pinned():
    budget = host_budget(32 * GiB, 4 * GiB, 8 * GiB, Residency())
    assert (budget.room, budget.bytes) == (28 * GiB, 8 * GiB)


def test_budget_zero_and_every_pin_plan_empty_when_committed_reaches_the_limit(write_config):
    config = _config(write_config, limit="8GiB")
    comps = _mapped(config, anonymous_extra=7 * GiB)  # + 1 GiB reserve = the limit
    plan = plan_deployment(config, comps, _host(config))
    assert plan.budget.committed == 7 * GiB and plan.budget.bytes == 0
    assert plan.pins.plans and all(not p.pinned_layers and p.pinned_bytes == 0 for p in plan.pins.plans.values())
    assert any(w.startswith("host budget is 0") for w in plan.warnings)
    # Less committed and pins come back, once the read-ahead window's room (a layer computing
    # and one read ahead: 128 MiB) is left: the test can fail both ways.
    comps = _mapped(config, anonymous_extra=7 * GiB - 128 * MiB)
    assert plan_deployment(config, comps, _host(config)).pins.pinned_bytes == 0
    comps = _mapped(config, anonymous_extra=7 * GiB - 192 * MiB)
    pins = plan_deployment(config, comps, _host(config)).pins
    assert pins.pinned_bytes == 64 * MiB and pins.window_bytes == 128 * MiB


def test_a_large_budget_pins_every_streamed_layer_before_any_text_encoder_byte(write_config):
    config = _config(write_config, limit="64GiB")
    plan = plan_deployment(config, _mapped(config), _host(config))
    dit, te = plan.pins.plans["dit"], plan.pins.plans["text_encoder"]
    assert list(plan.pins.plans) == ["dit", "text_encoder"]  # priority order: moves per request
    assert dit.pinned_layers == plan.device.streamed_layers and len(dit.pinned_layers) == 16
    assert dit.pinned_bytes == GiB and te.pinned_bytes == 256 * MiB
    assert dit.transfer_s_per_request < dit.baseline_transfer_s_per_request


def test_a_text_encoder_gets_only_what_is_left_in_whole_layers(write_config):
    # Budget: 1 GiB DiT + 100 MiB: one 64 MiB text-encoder layer fits, not two.
    config = _config(write_config, limit="4GiB", max_pinned=f"{GiB + 100 * MiB}B")
    plan = plan_deployment(config, _mapped(config), _host(config))
    assert plan.pins.plans["dit"].pinned_bytes == GiB
    assert plan.pins.plans["text_encoder"].pinned_layers == ("layers.0",)
    # A smaller budget: the DiT loses layers first and the text encoder gets nothing.
    config = _config(write_config, limit="4GiB", max_pinned="512MiB")
    plan = plan_deployment(config, _mapped(config), _host(config))
    assert plan.pins.plans["dit"].pinned_bytes == 512 * MiB
    assert plan.pins.plans["text_encoder"].pinned_bytes == 0


def _layers(prefix, count, nbytes, **residency):
    res = residency or {"file_backed": nbytes}
    return tuple(Layer(f"{prefix}.{i}", nbytes, Residency(**res)) for i in range(count))


def test_pinning_less_wins_when_the_cost_model_says_so():
    # Streamed layers of 130 MiB (moves 10x) are too big for the 120 MiB pin cap, so the
    # greedy choice pins the four 30 MiB text-encoder layers (the window's 130 MiB left
    # free). That leaves 180 MiB of the 300 MiB room for the DiT's 260 MiB of page cache:
    # it would be read from disk on every pass. One TE layer pinned still leaves it room.
    dit = MoveGroup("dit", _layers("blocks", 2, 130 * MiB), moves=10)
    te = MoveGroup("te", _layers("enc", 4, 30 * MiB), moves=1)
    budget = host_budget(GiB + 300 * MiB, GiB, 120 * MiB, Residency())
    plans = plan_pins([dit, te], budget, COST)
    assert plans.window_bytes == 130 * MiB  # 380 MiB do not fit in 300: a window of one 130 MiB layer
    assert plans.allowed_layers == 4  # the greedy choice: every TE layer
    assert plans.plans["te"].pinned_bytes == 30 * MiB  # ...cut back: more would push the DiT to disk
    assert plans.plans["dit"].page_cache_fits and plans.plans["dit"].disk_bytes_per_request == 0
    assert any("pinned 1 of the 4 blocks" in w for w in plans.warnings)


def test_pins_leave_the_read_ahead_windows_room_where_the_layers_do_not_all_fit():
    # 16 layers of 64 MiB, moves 8, 512 MiB of room and no cap: without the window the
    # greedy pins 8 layers and leaves no page cache for the 8 streamed through it.
    dit = MoveGroup("dit", _layers("blocks", 16, 64 * MiB), moves=8)
    budget = host_budget(GiB + 512 * MiB, GiB, 512 * MiB, Residency())
    plans = plan_pins([dit], budget, COST, prefetch=2)
    # a layer computing + one read ahead: prefetch 2 would be 128 MiB, more than a sixteenth of the stream
    assert plans.window_bytes == 2 * 64 * MiB
    assert plans.pinned_bytes <= 512 * MiB - plans.window_bytes and plans.room_after_pins >= plans.window_bytes
    # where every layer fits, no room is held back: everything is pinned
    roomy = plan_pins([dit], host_budget(3 * GiB, GiB, GiB, Residency()), COST, prefetch=2)
    assert roomy.window_bytes == 0 and roomy.pinned_bytes == GiB


def test_thrash_is_reported_with_the_disk_reads_it_costs():
    dit = MoveGroup("dit", _layers("blocks", 10, 100 * MiB), moves=4)
    budget = host_budget(GiB + 500 * MiB, GiB, 0, Residency())  # no pins, 500 MiB of cache
    plans = plan_pins([dit], budget, COST)
    plan = plans.plans["dit"]
    assert not plan.page_cache_fits and plan.disk_bytes_per_request == 4 * 1000 * MiB
    assert plan.transfer_s_per_request == pytest.approx(4 * 1000 * MiB * (1 / 8e9 + 1 / 3e9))
    # Nothing committed: the weights are larger than the host, a fact beside the plans, not advice.
    assert not plans.warnings
    (note,) = plans.notes
    assert note.startswith("dit reads 3.9 GiB from disk per request") and "only a larger host" in note
    # With committed anonymous memory the same thrash is a warning that names what to give back.
    budget = host_budget(GiB + 800 * MiB, GiB, 0, Residency(anonymous=300 * MiB))
    plans = plan_pins([dit], budget, COST)
    (warning,) = plans.warnings
    assert warning.startswith("page-cache thrash: dit reads") and "Give back the 300.0 MiB" in warning
    assert not plans.notes


def test_anonymous_layers_cost_nothing_more_to_pin():
    layers = _layers("blocks", 4, 100 * MiB, anonymous=100 * MiB)
    budget = host_budget(GiB + 50 * MiB, GiB, 10 * GiB, Residency(anonymous=400 * MiB))
    assert budget.room == 0 and budget.bytes == 0  # committed anonymous ate the room...
    budget = host_budget(2 * GiB, GiB, 10 * GiB, Residency(anonymous=400 * MiB))
    plans = plan_pins([MoveGroup("dit", layers, 4)], budget, COST)
    assert plans.plans["dit"].pinned_bytes == 400 * MiB and plans.plans["dit"].net_cost_bytes == 0


def test_the_device_plan_keeps_whole_layers_under_the_cap():
    sizes = from_declared("dit", "layerwise", 16 * 100 * MiB, 16)
    plan = plan_device(sizes, vram=1000 * MiB, reserve=200 * MiB, prefetch=1)
    # 800 MiB usable - a window of 2 layers (200 MiB) = 600 MiB: 6 layers resident.
    assert plan.window_bytes == 200 * MiB and len(plan.resident_layers) == 6
    assert plan.streamed_layers == tuple(f"layers.{i}" for i in range(6, 16))
    everything = plan_device(sizes, vram=2 * GiB, reserve=0, prefetch=1)
    assert not everything.streamed_layers and everything.window_bytes == 0
    host_only = plan_device(sizes, vram=0, reserve=0, prefetch=1)
    assert not host_only.resident_layers and len(host_only.streamed_layers) == 16 and host_only.fits


def test_a_window_larger_than_the_model_holds_the_model_once():
    """``prefetch`` past the layer count puts every layer on its way at once, never more."""
    sizes = from_declared("dit", "layerwise", 16 * 100 * MiB, 16)
    plan = plan_device(sizes, vram=1000 * MiB, reserve=200 * MiB, prefetch=30)
    assert plan.window_bytes == 16 * 100 * MiB and not plan.fits
    assert plan_device(sizes, vram=2 * GiB, reserve=200 * MiB, prefetch=30).window_bytes <= 16 * 100 * MiB


def test_auto_limit_is_the_tighter_of_memtotal_and_the_cgroup():
    assert resolve_host_limit(None, 64 * GiB, 16 * GiB) == HostLimit(16 * GiB, "cgroup", 64 * GiB, 16 * GiB)
    assert resolve_host_limit(None, 64 * GiB, None).source == "MemTotal"
    assert resolve_host_limit(None, 64 * GiB, 128 * GiB).bytes == 64 * GiB
    configured = resolve_host_limit(32 * GiB, 64 * GiB, 16 * GiB, "HOSTMEM_HOST_LIMIT")
    assert (configured.bytes, configured.source, configured.machine_bytes) == (32 * GiB, "HOSTMEM_HOST_LIMIT", 16 * GiB)
