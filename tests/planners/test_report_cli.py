"""`hostmem plan`: the JSON contract, the text report, errors, the shipped configs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from planners.cli import main
from planners.report import compress_names

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEED = os.path.join(REPO, "configs", "minimax-h3-32g.yaml")

CONTRACT = {
    "deployment": None,
    "host": {"limit_bytes", "source", "mem_total_bytes", "cgroup_limit_bytes"},
    "budget": {"bytes", "reserve_bytes", "committed_bytes"},
    "components": {"anonymous", "file_backed", "pinned", "total"},
    "device_plan": {"resident_layers", "streamed_layers"},
    "pin_plans": {"pinned_bytes", "pinned_layers", "transfer_s_per_request", "baseline_transfer_s_per_request"},
    "warnings": None,
}


def _plan(capsys, *argv) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_json_report_keeps_the_contract(capsys):
    code, out, _ = _plan(capsys, SEED, "--json")
    assert code == 0
    report = json.loads(out)
    for key, inner in CONTRACT.items():
        assert key in report
        if key in ("components", "pin_plans"):
            for entry in report[key].values():
                assert inner <= set(entry), (key, inner - set(entry))
        elif inner:
            assert inner <= set(report[key]), (key, inner - set(report[key]))
    assert isinstance(report["budget"]["bytes"], int) and isinstance(report["warnings"], list)
    assert report["components"]["dit"]["total"] == 61_700_000_000
    assert report["merge"] == "cached"  # the config's cache is enabled


def test_the_seed_case_in_place_leaves_no_budget_and_the_cache_gives_it_back(capsys):
    code, out, _ = _plan(capsys, SEED, "--json", "--what-if", "in-place")
    assert code == 0
    report = json.loads(out)
    assert report["budget"]["bytes"] == 0
    assert all(p["pinned_bytes"] == 0 and p["pinned_layers"] == [] for p in report["pin_plans"].values())
    assert report["components"]["dit"]["anonymous"] == 38 * 10**9  # merged layers (the mapped base: its own snapshot)
    assert any("killed while it loads" in w for w in report["warnings"])
    (offer,) = report["offers"]
    assert offer["provider"] == "lora_cache" and offer["budget_bytes"] == 24 * 1024**3


def test_the_text_report_is_aligned_and_human(capsys):
    code, out, _ = _plan(capsys, SEED, "--what-if", "cached")
    assert code == 0
    table = out.split("pin plans:\n")[1].split("\n\n")[0].splitlines()
    rows = [line for line in table if not line.lstrip().startswith(("dit pinned", "text_encoder pinned", "note:"))]
    assert len({len(r) for r in rows}) == 1, rows  # right-aligned columns end together
    assert re.search(r"budget for pins\s+24\.0 GiB", out)
    # 24 GiB - 2 GiB reserve - the 14.0 GiB text encoder in flight (larger than the DiT's window): 8 GiB of
    # 29 blocks of 61.7 GB / 208 = 0.276 GiB each
    assert "dit: resident 29 of 208 blocks" in out and "layers.29..207" in out
    assert not re.search(r"\d{5,} ?B\b", out)  # no raw byte counts for people
    # The in-place plan beside it is killed while loading: no transfer time that looks better.
    compared = out.split("compared (")[1].split("\n\n")[0]
    assert re.search(r"without the LoRA merge cache\s+in-place\s+35\.4 GiB\s+0 B\s+0 B\s+0\s+killed while loading",
                     compared)
    assert "use a cached" not in out and "--what-if cached" not in out.split("warnings:")[1]


def test_a_config_error_is_one_line_with_file_key_and_line(capsys, write_config):
    path = write_config("deployment: x\nworkload: {steps: 1}\nhost:\n  limit: 32GiB\n  reserve: 33GiB\n"
                        "components:\n  dit: {size: 1GiB, layers: 2, offload: layerwise}\n")
    code, out, err = _plan(capsys, path)
    assert code == 2 and out == ""
    assert err.strip() == (f"hostmem: error: {path}:5: host.reserve: '33GiB' is not below host.limit '32GiB'; "
                           "lower the reserve or raise the limit")


def test_the_default_cached_plan_shows_the_budget_without_the_cache(capsys):
    code, out, _ = _plan(capsys, SEED, "--json")
    assert code == 0
    report = json.loads(out)
    assert report["merge"] == "cached" and report["budget"]["bytes"] == 24 * 1024**3
    assert "lora.cache is enabled" in report["merge_reason"]
    (without,) = report["alternatives"]
    assert without["label"] == "without the LoRA merge cache" and without["merge"] == "in-place"
    assert without["committed_bytes"] == 38 * 10**9  # the merged layers
    assert without["budget_bytes"] == 0 and without["pinned_bytes"] == 0
    assert all(layers == [] for layers in without["pinned_layers"].values())
    assert without["over_limit_bytes"] == 38 * 10**9 - 32 * 1024**3
    in_place = json.loads(_plan(capsys, SEED, "--json", "--what-if", "in-place")[1])
    assert without["budget_bytes"] == in_place["budget"]["bytes"]
    assert without["transfer_s_per_request"] == in_place["transfer_s_per_request"]
    code, text, _ = _plan(capsys, SEED)
    assert "without the LoRA merge cache: budget 0 B, pins 0 B (this plan: budget 24.0 GiB, pins 23.8 GiB)" in text
    rows = text.split("compared (")[1].split("\n\n")[0].splitlines()[1:4]
    assert rows[1].split()[:3] == ["this", "plan", "cached"] and rows[2].split()[5:8] == ["in-place", "35.4", "GiB"]
    assert len({len(r) for r in rows}) == 1, rows  # aligned


def test_hostmem_disable_lora_merge_cache_plans_the_in_place_merge(capsys, monkeypatch):
    monkeypatch.setenv("HOSTMEM_DISABLE_LORA_MERGE_CACHE", "1")
    code, out, _ = _plan(capsys, SEED, "--json")
    assert code == 0
    report = json.loads(out)
    assert report["merge"] == "in-place" and report["budget"]["bytes"] == 0
    assert report["components"]["dit"]["anonymous"] == 38 * 10**9
    assert "HOSTMEM_DISABLE_LORA_MERGE_CACHE=1 turns the LoRA merge cache off" in report["merge_reason"]
    assert report["offers"] == [] and report["alternatives"] == []  # a cache that is off offers nothing
    code, text, _ = _plan(capsys, SEED)
    assert text.splitlines()[0].startswith("fits: no: committed 35.4 GiB > limit 32.0 GiB")
    assert text.splitlines()[2].startswith("merge in-place: HOSTMEM_DISABLE_LORA_MERGE_CACHE=1 turns")
    monkeypatch.setenv("HOSTMEM_DISABLE_LORA_MERGE_CACHE", "0")
    assert json.loads(_plan(capsys, SEED, "--json")[1])["merge"] == "cached"


def test_hostmem_plan_stays_torch_free():
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "planners.cli", "plan", SEED],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HOSTMEM_DISABLE_LORA_MERGE_CACHE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "import time:" in done.stderr
    assert not [line for line in done.stderr.splitlines() if line.endswith(" torch")]


def test_the_small_shipped_config_plans_the_synthetic_model_on_a_clean_clone(capsys, tmp_path):
    from planners.demo.run import DemoSettings
    from planners.demo.synthetic import TEXT_ENCODER_SHARE, dit_dims

    os.makedirs(tmp_path / "configs")  # a clean clone: no bench/out next to it
    shutil.copy(os.path.join(REPO, "configs", "demo.yaml"), tmp_path / "configs" / "demo.yaml")
    code, out, _ = _plan(capsys, str(tmp_path / "configs" / "demo.yaml"), "--json")
    assert code == 0
    report = json.loads(out)
    scale = DemoSettings().scale
    hidden, blocks = dit_dims(scale)
    dit, te = report["components"]["dit"], report["components"]["text_encoder"]
    assert dit["layers"] == blocks and dit["source"] == "declared"
    assert dit["total"] == pytest.approx(16 * hidden * hidden * 2 * blocks, rel=0.01)  # 16 d x d per block
    assert dit["lora_target_bytes"] == 10 * hidden * hidden * 2 * blocks  # 10 of them are LoRA targets
    assert te["total"] == pytest.approx(scale * TEXT_ENCODER_SHARE, rel=0.05)
    assert report["merge"] == "cached" and report["budget"]["bytes"] == int(0.75 * report["host"]["limit_bytes"])
    (without,) = report["alternatives"]
    assert without["budget_bytes"] == 0 and without["over_limit_bytes"] > 0  # in place, the demo's OOM
    assert report["pin_plans"]["dit"]["pinned_layers"]


def test_the_installed_command_runs(tmp_path):
    hostmem = os.path.join(os.path.dirname(sys.executable), "hostmem")
    done = subprocess.run([hostmem, "plan", os.path.join(REPO, "configs", "workstation-24g.yaml")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1] == "hostmem plan: workstation-24g-wan14b (what-if, merge: none)"


@pytest.mark.parametrize("names, text", [
    (["blocks.0", "blocks.1", "blocks.2", "blocks.5"], "blocks.0..2, blocks.5"),
    (["(rest)", "enc.3"], "(rest), enc.3"),
    ([], "none"),
])
def test_layer_lists_are_compressed(names, text):
    assert compress_names(names) == text


def test_the_shipped_configs_warn_only_about_a_machine_smaller_than_their_host(capsys):
    """demo and workstation plan clean here; the seed case's 32 GiB convention warns only on a smaller machine.

    demo and minimax name an adapter file a clean clone does not hold: the plan (declared
    sizes, it reads no adapter) names it in a warning, and nothing else."""
    from hostmem.procfs import read_meminfo

    for name in ("demo.yaml", "workstation-24g.yaml", "minimax-h3-32g.yaml"):
        code, out, _ = _plan(capsys, os.path.join(REPO, "configs", name), "--json")
        assert code == 0
        warnings = json.loads(out)["warnings"]
        missing = [w for w in warnings if w.startswith("adapter ") and "does not exist" in w]
        assert all(".safetensors (" in w and f"{name}:" in w for w in missing), (name, missing)
        warnings = [w for w in warnings if w not in missing]
        if name.startswith("minimax") and read_meminfo().total * 1.04 < 32 * 1024**3:
            assert len(warnings) == 1 and warnings[0].startswith("host limit 32.0 GiB is larger than this machine")
        else:
            assert warnings == [], (name, warnings)
