"""One host budget split across the local ranks: the rule, and plan_loaded under torchrun's variables."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from planners.host_share import local_world, split_host_budget
from planners.report import report_dict, report_text
from planners.startup import plan_loaded

from .conftest import MiB, load_dit_and_text_encoder, pins_config


def test_a_budget_that_covers_every_need_gives_each_rank_its_need():
    assert split_host_budget(100, [10, 0, 30]) == [10, 0, 30]


def test_a_short_budget_is_split_in_proportion_to_need():
    assert split_host_budget(100, [100, 300, 0, 100]) == [20, 60, 0, 20]
    assert split_host_budget(10, [1, 1, 1]) == [1, 1, 1]
    assert split_host_budget(2, [1, 1, 1]) == [0, 0, 0]  # rounded down: never more than the budget


@given(st.integers(0, 1 << 50), st.lists(st.integers(0, 1 << 45), min_size=1, max_size=16))
def test_shares_never_exceed_the_budget_nor_a_need(budget, needs):
    shares = split_host_budget(budget, needs)
    assert sum(shares) <= budget
    assert all(0 <= s <= n for s, n in zip(shares, needs))
    assert sum(shares) >= min(budget, sum(needs)) - len(needs)  # rounding loses under a byte per rank


def test_negative_sizes_are_refused():
    with pytest.raises(ValueError, match="must not be negative"):
        split_host_budget(10, [5, -1])


def test_torchruns_variables_name_the_local_world():
    assert local_world({}) is None
    assert local_world({"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "3"}) == (3, 4)
    with pytest.raises(ValueError, match="LOCAL_RANK=4 is not within LOCAL_WORLD_SIZE=4"):
        local_world({"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "4"})
    with pytest.raises(ValueError, match=r"^LOCAL_WORLD_SIZE=0: the ranks on this host are 1 to 1024"):
        local_world({"LOCAL_WORLD_SIZE": "0"})  # no LOCAL_RANK was named: none is blamed
    with pytest.raises(ValueError, match=r"^LOCAL_WORLD_SIZE=2000: the ranks on this host are 1 to 1024, as --ranks"):
        local_world({"LOCAL_WORLD_SIZE": "2000"})  # --ranks 2000 is refused: the variable was taken
    assert local_world({"LOCAL_RANK": "-1"}) is None  # many scripts' default: not distributed
    with pytest.raises(ValueError, match="expected whole numbers"):
        local_world({"LOCAL_WORLD_SIZE": "four"})


# The host has 100 MiB above four reserves; each rank could pin 12 x 4 MiB of streamed DiT
# layers and an 8 MiB text encoder: 56 MiB, 224 MiB for four ranks.
CONFIG = pins_config("host-share", "4196MiB", "1GiB")


@pytest.fixture
def loaded(tmp_path):
    return load_dit_and_text_encoder(tmp_path, CONFIG, 4 * MiB)


def test_under_torchrun_each_rank_pins_within_its_share_of_one_host_budget(loaded, monkeypatch):
    config, modules = loaded
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    alone = plan_loaded(config, modules)
    assert alone.host_share is None and report_dict(alone)["host_share"] is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    plan = plan_loaded(config, modules)
    share = report_dict(plan)["host_share"]
    assert share["local_rank"] == 1 and share["local_world_size"] == 4
    assert share["source"] == "LOCAL_WORLD_SIZE (no process group)"
    assert share["needs_bytes"] == [56 * MiB] * 4
    host = share["host_budget_bytes"]
    assert 0 < host <= 100 * MiB and alone.budget.bytes > host
    assert sum(share["shares_bytes"]) <= host and share["share_bytes"] == host // 4
    assert plan.budget.bytes == share["share_bytes"]
    assert plan.pins.pinned_bytes <= share["share_bytes"] < alone.pins.pinned_bytes
    text = report_text(plan)
    assert "host share: local rank 1 of 4 (from LOCAL_WORLD_SIZE (no process group); ranks taken to be alike" in text


def test_under_torchrun_the_verdict_is_the_hosts_not_one_rank_against_the_whole_limit(tmp_path, monkeypatch):
    """Four alike ranks each holding a copied DiT and the config's reserve, on a host that
    holds one of them but not four: each rank's live start says "fits: no" with the ranks'
    figures, as ``hostmem plan --ranks 4`` does; alone, the same start fits."""
    import torch
    from torch import nn

    from hostmem.units import format_size
    from planners.config import load_config

    from hostmem.procfs import read_status

    reserve = (read_status().rss_anon // MiB + 64) * MiB  # this process's runtime and more
    config = tmp_path / "ranks.yaml"
    config.write_text(f"deployment: ranks\nhost: {{limit: {reserve + 96 * MiB}B, reserve: {reserve}B, "
                      "max_pinned: 75%}\ndevice: {vram: 0}\nworkload: {steps: 4}\n"
                      "components:\n  dit: {size: 24MiB, layers: 6, offload: layerwise, load: copied}\n")
    dit = nn.Module()
    dit.layers = nn.ModuleList(nn.Linear(1024, 1024, bias=False) for _ in range(6))  # 6 x 4 MiB, anonymous
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert plan_loaded(load_config(config), {"dit": dit}, quiet=True).fits
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    plan = plan_loaded(load_config(config), {"dit": dit}, quiet=True)
    assert not plan.fits
    assert plan.verdict.line.startswith("fits: no: committed by the 4 ranks on this host ")
    assert f"+ reserve 4 x {format_size(reserve)} = {format_size(4 * reserve)} > host limit " in plan.verdict.line
    (zero,) = [w for w in plan.warnings if w.startswith("host budget is 0")]
    # against this rank's part of the limit (its reserve, what it commits, no room left by the four)
    assert zero.startswith("host budget is 0: committed non-reclaimable 24.0 MiB and the reserve "), zero
    assert f"reach the limit {format_size(plan.host.bytes)}, so nothing is pinned" in zero, zero
    assert plan.host.bytes == reserve + 24 * MiB  # the rank's part: nothing beyond its reserve and its DiT
    del torch


def test_a_live_rank_under_torchrun_plans_its_part_of_the_host_as_plan_with_ranks_does(tmp_path, monkeypatch):
    """Each of four alike ranks planned its page cache against the whole host: the room of
    all four where ``hostmem plan --ranks 4`` gives each a quarter, so every rank counted on
    the others' page cache (no disk reads predicted, every block pinned)."""
    import json
    import subprocess
    import sys

    from hostmem.procfs import read_status
    from planners.config import load_config

    from .conftest import mapped_module, write_checkpoint

    write_checkpoint(tmp_path / "dit", 12, 16 * MiB)
    write_checkpoint(tmp_path / "te", 4, 8 * MiB, prefix="enc")
    modules = {"dit": mapped_module(tmp_path / "dit"), "text_encoder": mapped_module(tmp_path / "te")}
    reserve = (read_status().rss_anon // MiB + 64) * MiB  # this process's runtime and more: no excess to count
    limit = 4 * (reserve + 168 * MiB)
    config = tmp_path / "ranks.yaml"
    config.write_text(f"deployment: ranks-live\nhost: {{limit: {limit}B, reserve: {reserve}B, max_pinned: 100%}}\n"
                      "device: {vram: 100MiB, reserve: 20MiB}\nworkload: {steps: 4}\ncomponents:\n"
                      '  dit: {path: dit, layers: "blocks.{i}.", offload: layerwise}\n'
                      '  text_encoder: {path: te, layers: "enc.{i}.", offload: full}\n')
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    live = plan_loaded(load_config(config), modules, quiet=True)
    done = subprocess.run([sys.executable, "-m", "planners.cli", "plan", str(config), "--ranks", "4", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    what_if = json.loads(done.stdout)
    assert live.budget.process_excess == 0
    assert live.host.bytes == what_if["budget"]["limit_bytes"] == limit // 4
    assert live.budget.room == what_if["budget"]["room_bytes"] == 168 * MiB
    for name in ("dit", "text_encoder"):
        ours, theirs = live.pins.plans[name], what_if["pin_plans"][name]
        assert list(ours.pinned_layers) == theirs["pinned_layers"], name
        assert ours.disk_bytes_per_request == theirs["disk_bytes_per_request"], name
