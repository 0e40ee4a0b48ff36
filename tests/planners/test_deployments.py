"""Three real deployments declared by size, their verdicts and per-request figures worked by hand.

Each figure below is written as the arithmetic that gives it (GB = 10^9 bytes, GiB = 2^30,
rates 24/8/3 GB/s pinned/pageable/disk), and compared with what ``hostmem plan --json``
prints for the config in configs/.
"""

from __future__ import annotations

import json
import os

import pytest

from planners.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GB, GiB = 10**9, 2**30
PINNED, PAGEABLE, DISK = 24 * GB, 8 * GB, 3 * GB


def _plan(capsys, name, *argv, environ=None) -> tuple[int, dict]:
    code = main(["plan", os.path.join(REPO, "configs", name), "--check", "--json", *argv])
    return code, json.loads(capsys.readouterr().out)


def test_flux1_dev_on_one_h100_keeps_the_whole_dit_on_the_device(capsys):
    code, r = _plan(capsys, "flux1-dev-h100-32g.yaml")
    assert code == 0 and r["fits"]
    d = r["device_plan"]
    assert d["vram_bytes"] == 80 * GB  # 80GB as the vendor prints it, not 80 GiB
    # 80 GB - 10 GB reserve = 70 GB holds the 23.8 GB DiT and the 9.5 GB encoder in flight: no window
    assert len(d["resident_layers"]) == 57 and d["streamed_layers"] == [] and d["window_bytes"] == 0
    assert d["peak_bytes"] == 10 * GB + 23.8 * GB + 9.5 * GB and d["peak_component"] == "text_encoder"
    assert r["budget"]["bytes"] == 24 * GiB  # 32 GiB - 4 GiB = 28 GiB of room, capped at 75% of 32 GiB
    te = r["pin_plans"]["text_encoder"]
    assert te["pinned_bytes"] == 9.5 * GB and te["disk_bytes_per_request"] == 0  # the encoder, pinned whole
    assert r["transfer_s_per_request"] == pytest.approx(9.5 * GB / PINNED)  # 0.40 s: one move, pinned
    assert r["baseline_transfer_s_per_request"] == pytest.approx(9.5 * GB / PAGEABLE)


def test_wan22_a14b_streams_both_experts_each_with_its_own_window(capsys):
    code, r = _plan(capsys, "wan22-a14b-48g.yaml")
    assert code == 0 and r["fits"]
    d = r["device_plan"]["components"]
    layer = 28 * GB // 40  # 0.7 GB
    # 48 GB - 6 GB reserve - the 11 GB encoder in flight = 31 GB: the high-noise expert's 40 blocks (28 GB),
    # then 4 of the low-noise one's (2.8 GB); every block of both moves 20 steps x 2 passes = 40 times
    assert len(d["dit_high"]["resident_layers"]) == 40 and d["dit_high"]["window_bytes"] == 0
    assert len(d["dit_low"]["resident_layers"]) == 4 and d["dit_low"]["window_bytes"] == 2 * layer
    assert r["device_plan"]["peak_bytes"] == 6 * GB + 28 * GB + 4 * layer + 11 * GB  # 47.8 GB of 48 GB
    low = r["pin_plans"]["dit_low"]
    assert low["moves_per_request"] == 40 and low["candidate_layers"] == 36
    # max_pinned 16 GiB = 17.18 GB: 24 blocks of 0.7 GB (16.8 GB); 12 stay in page cache (8.4 GB) with the
    # encoder's 11 GB, well within 64 GiB - 6 GiB - 16.8 GB
    assert low["pinned_bytes"] == 24 * layer and low["page_cache_bytes"] == 12 * layer and low["page_cache_fits"]
    per_pass = 24 * layer / PINNED + 12 * layer / PAGEABLE  # 0.70 s + 1.05 s
    assert low["transfer_s_per_request"] == pytest.approx(40 * per_pass)  # 70.0 s
    assert r["transfer_s_per_request"] == pytest.approx(40 * per_pass + 11 * GB / PAGEABLE)  # + 1.375 s


def test_wan22_experts_in_a_page_cache_too_small_for_both_read_back_once_per_turn(capsys, tmp_path):
    text = open(os.path.join(REPO, "configs", "wan22-a14b-48g.yaml")).read()
    small = (text.replace("limit: 64GiB", "limit: 48GiB").replace("max_pinned: 16GiB", "max_pinned: 8GiB")
             .replace("vram: 48GB", "vram: 24GB"))
    path = tmp_path / "wan-24g.yaml"
    path.write_text(small)
    assert main(["plan", str(path), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    layer = 28 * GB // 40
    high, low = r["pin_plans"]["dit_high"], r["pin_plans"]["dit_low"]
    # 24 GB - 6 GB - 11 GB in flight = 7 GB: 10 high-noise blocks resident; 30 + 40 stream
    assert high["candidate_layers"] == 30 and low["candidate_layers"] == 40
    room = 48 * GiB - 6 * GiB - high["pinned_bytes"] - low["pinned_bytes"]
    needs = high["page_cache_bytes"], low["page_cache_bytes"]
    assert sum(needs) > room  # together too large; each alone fits: read back once per turn
    for plan, need, other in ((high, needs[0], needs[1]), (low, needs[1], needs[0])):
        assert plan["disk_bytes_per_request"] == need - (room - other) > 0
        moved = (30 if plan is high else 40) * layer
        seconds = 40 * (plan["pinned_bytes"] / PINNED + (moved - plan["pinned_bytes"]) / PAGEABLE)
        assert plan["transfer_s_per_request"] == pytest.approx(seconds + plan["disk_bytes_per_request"] / DISK)
        # the executor keeps every unpinned block of an expert in its turn, as this figure assumes: it
        # kept the first expert whole and released every block of the second, read again on every move
        assert len(plan["kept_layers"]) == plan["candidate_layers"] - len(plan["pinned_layers"]) > 0
    assert any("once at the start of its turn" in n for n in r["notes"])


def test_a_full_expert_larger_than_the_card_fails_naming_it(capsys, tmp_path):
    text = open(os.path.join(REPO, "configs", "wan22-a14b-48g.yaml")).read()
    one = text.replace("vram: 48GB", "vram: 24GB").replace("""    offload: layerwise
    steps: 20             # the low-noise expert: steps 21-40""", "    offload: full").replace(
        "    steps: 20             # the high-noise expert: steps 1-20\n", "")
    path = tmp_path / "wan-full.yaml"
    path.write_text(one)
    assert main(["plan", str(path), "--check"]) == 1
    out = capsys.readouterr().out
    # 6 GB reserve + 28 GB in flight = 34 GB > 24 GB, before any block is kept
    assert out.startswith("fits: no: device: 34.0 GB (31.7 GiB) needed while dit_low runs")
    assert "short by 10.0 GB (9.3 GiB)" in out.splitlines()[0]


def test_qwen_image_on_four_tensor_parallel_ranks_plans_a_rank_and_the_host(capsys):
    code, r = _plan(capsys, "qwen-image-tp4-128g.yaml")
    assert code == 0 and r["fits"]
    share = r["host_share"]
    part = (40.9 * GB // 60 // 4)  # each rank holds a quarter of every one of the 60 blocks
    assert share["local_world_size"] == 4 and share["tensor_parallel"] == 4
    assert share["parts_bytes"] == {"dit": 60 * part} and r["components"]["dit"]["weights_bytes"] == 60 * part
    # a quarter of the host: 32 GiB limit, a whole 6 GiB reserve, 24 GiB (75% of 128 GiB / 4) for pins
    assert share["limit_per_rank_bytes"] == 32 * GiB and share["reserve_per_rank_bytes"] == 6 * GiB
    assert r["budget"]["bytes"] == 24 * GiB and share["host_budget_bytes"] == 96 * GiB
    # split by need, as live ranks split it: each rank's need, within its quarter
    assert share["shares_bytes"] == share["needs_bytes"] and share["share_bytes"] == share["needs_bytes"][0] <= 24 * GiB
    assert share["host_reserve_bytes"] == 24 * GiB
    assert "4 x 6.0 GiB = 24.0 GiB within host limit 128.0 GiB (4 ranks)" in r["verdict"]
    # per rank: 24 GB - 2 GB - the 16.6 GB encoder in flight = 5.4 GB: 31 blocks resident, 29 stream
    d = r["device_plan"]
    assert len(d["resident_layers"]) == 31 and d["peak_bytes"] == 2 * GB + 31 * part + 16.6 * GB
    dit = r["pin_plans"]["dit"]
    assert dit["pinned_bytes"] == 29 * part and dit["moves_per_request"] == 100  # everything fits the share
    assert r["transfer_s_per_request"] == pytest.approx(100 * 29 * part / PINNED + 16.6 * GB / PINNED)


def test_ranks_from_torchrun_or_the_command_line_give_the_host_its_verdict(capsys, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "5")
    code, r = _plan(capsys, "qwen-image-tp4-128g.yaml")
    assert code == 0 and r["host_share"]["local_rank"] == 5 and r["host_share"]["local_world_size"] == 8
    assert r["budget"]["limit_bytes"] == 16 * GiB and r["budget"]["bytes"] == 10 * GiB  # 16 GiB - 6 GiB reserve
    # 24 ranks of a 6 GiB reserve ask 144 GiB of a 128 GiB host: --ranks wins over LOCAL_WORLD_SIZE
    code, r = _plan(capsys, "qwen-image-tp4-128g.yaml", "--ranks", "24")
    assert code == 1 and r["verdict"] == (
        "fits: no: committed 24 x 0 B = 0 B + reserve 24 x 6.0 GiB = 144.0 GiB > host limit 128.0 GiB (24 ranks): "
        "killed at the first request")
