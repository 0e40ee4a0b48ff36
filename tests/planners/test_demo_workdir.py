"""`hostmem demo`: a relative --workdir, a scale small enough for CI, and a scale too large refused.

The demo writes a config beside its files that names them relative to itself; a
relative workdir used to be joined twice. A scale larger than the free disk or memory
must be refused with the figures before the first byte is written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from planners.demo.room import RUNTIME_ALLOWANCE, check_room, demo_needs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1024 * 1024


def _hostmem(cwd, *argv, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planners.cli", *argv], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, env={**os.environ, "PYTHONPATH": REPO})


def test_a_relative_workdir_at_a_small_scale_runs_and_its_config_plans(tmp_path):
    done = _hostmem(tmp_path, "demo", "--scale", "16MiB", "--workdir", "out/demo", "--json", "figures.json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert (tmp_path / "out" / "demo" / "demo.yaml").is_file() and not (tmp_path / "out" / "demo" / "out").exists()
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert [s["name"] for s in figures["scenarios"]] == ["base", "in_place", "cached_miss", "cached_hit"]
    for merge in ("in-place", "cached"):  # the demo's own config, planned by path from the relative folder
        plan = _hostmem(tmp_path, "plan", "out/demo/demo.yaml", "--check", "--json", "--what-if", merge, timeout=120)
        assert plan.returncode in (0, 1), plan.stderr
        assert json.loads(plan.stdout)["fits"] is (plan.returncode == 0)


def test_a_scale_larger_than_the_machine_is_refused_before_anything_is_written(tmp_path):
    done = _hostmem(tmp_path, "demo", "--scale", "1PB", "--workdir", "out/demo", timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    line = done.stderr.strip()
    assert line.startswith("hostmem: error: --scale 909.5 TiB: the demo needs ") and "of disk under" in line
    assert "nothing was written" in line and "Choose --scale" in line
    assert not (tmp_path / "out").exists()


def test_the_room_check_names_memory_alone_and_the_largest_scale_that_fits(tmp_path):
    disk, memory = demo_needs(256 * MiB)
    assert disk > 256 * MiB and memory > RUNTIME_ALLOWANCE
    check_room(256 * MiB, str(tmp_path), available_memory=memory)  # exactly enough: no refusal
    with pytest.raises(ValueError) as refused:
        check_room(256 * MiB, str(tmp_path), available_memory=memory - 1)
    said = str(refused.value)
    assert "of memory for the in-place start" in said and "of disk" not in said
