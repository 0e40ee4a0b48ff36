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

from .conftest import MiB, write_checkpoint

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
    assert report["components"]["dit"]["anonymous"] == 2 * 38 * 10**9  # merged layers + snapshot
    assert any("killed while it loads" in w for w in report["warnings"])
    (offer,) = report["offers"]
    assert offer["provider"] == "lora_cache" and offer["budget_bytes"] == 24 * 1024**3


def test_the_text_report_is_aligned_and_human(capsys):
    code, out, _ = _plan(capsys, SEED, "--what-if", "cached")
    assert code == 0
    table = out.split("pin plans:\n")[1].split("\n\n")[0].splitlines()
    rows = [line for line in table if not line.lstrip().startswith(("dit pinned", "text_encoder pinned"))]
    assert len({len(r) for r in rows}) == 1, rows  # right-aligned columns end together
    assert re.search(r"budget for pins\s+24\.0 GiB", out)
    assert "resident 34 of 208" in out and "layers.34..207" in out
    assert not re.search(r"\d{5,} ?B\b", out)  # no raw byte counts for people


def test_a_config_error_is_one_line_with_file_key_and_line(capsys, write_config):
    path = write_config("deployment: x\nworkload: {steps: 1}\nhost:\n  limit: 32GiB\n  reserve: 33GiB\n"
                        "components:\n  dit: {size: 1GiB, layers: 2, offload: layerwise}\n")
    code, out, err = _plan(capsys, path)
    assert code == 2 and out == ""
    assert err.strip() == (f"hostmem: error: {path}:5: host.reserve: '33GiB' is not below host.limit '32GiB'; "
                           "lower the reserve or raise the limit")


def test_the_demo_config_plans_a_checkpoint_laid_out_as_the_demo_writes_it(capsys, tmp_path):
    shutil.copy(os.path.join(REPO, "configs", "demo.yaml"), tmp_path / "demo.yaml")
    os.makedirs(tmp_path / "configs")
    shutil.move(tmp_path / "demo.yaml", tmp_path / "configs" / "demo.yaml")
    out_dir = tmp_path / "bench" / "out" / "demo"
    write_checkpoint(out_dir / "transformer", 16, 2 * MiB, rest_bytes=MiB, files=2)
    te = write_checkpoint(tmp_path / "te", 3, 2 * MiB, prefix="encoder.block")
    shutil.move(os.path.join(te, "model-00000.safetensors"), out_dir / "text_encoder.safetensors")
    code, out, _ = _plan(capsys, str(tmp_path / "configs" / "demo.yaml"), "--json")
    assert code == 0
    report = json.loads(out)
    assert report["components"]["dit"]["layers"] == 16 and report["components"]["text_encoder"]["layers"] == 3
    assert report["components"]["dit"]["source"] == "headers"
    assert len(report["device_plan"]["resident_layers"]) == 16  # 33 MiB fits the 2 GiB device
    assert report["pin_plans"]["text_encoder"]["pinned_layers"] == [f"encoder.block.{i}" for i in range(3)]


def test_the_installed_command_runs(tmp_path):
    hostmem = os.path.join(os.path.dirname(sys.executable), "hostmem")
    done = subprocess.run([hostmem, "plan", os.path.join(REPO, "configs", "workstation-24g.yaml")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("hostmem plan: workstation-24g-wan14b (what-if, merge: none)")


@pytest.mark.parametrize("names, text", [
    (["blocks.0", "blocks.1", "blocks.2", "blocks.5"], "blocks.0..2, blocks.5"),
    (["(rest)", "enc.3"], "(rest), enc.3"),
    ([], "none"),
])
def test_layer_lists_are_compressed(names, text):
    assert compress_names(names) == text
