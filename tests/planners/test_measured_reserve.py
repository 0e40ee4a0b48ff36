"""host.reserve: measured: one warmup request under the peak tracker, remembered per deployment."""

from __future__ import annotations

import json
import os

import pytest
import torch

from planners.config import load_config
from planners.report import report_dict, report_text
from planners.reserve import measure_reserve, record_path, remembered
from planners.startup import plan_loaded
from tests.conftest import run_python

from .conftest import MiB, mapped_module, write_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = """
deployment: measured-reserve
host: {{limit: 6GiB, reserve: {reserve}, reserve_floor: 32MiB, max_pinned: 100%}}
workload: {{steps: 2}}
components:
  dit: {{path: dit, layers: "blocks.{{i}}.", offload: layerwise}}
"""
WARMUP = 192 * MiB


@pytest.fixture
def deployment(tmp_path, monkeypatch):
    """A config (``write(reserve)``), its DiT loaded, and the cache root the record goes to."""
    monkeypatch.setenv("HOSTMEM_CACHE_ROOT", str(tmp_path / "cache"))
    write_checkpoint(tmp_path / "dit", 4, MiB)

    def write(reserve: str):
        (tmp_path / "deploy.yaml").write_text(CONFIG.format(reserve=reserve).lstrip())
        return load_config(tmp_path / "deploy.yaml", environ={})

    return write, {"dit": mapped_module(tmp_path / "dit")}, tmp_path


def one_request() -> None:
    """A warmup that allocates WARMUP bytes of activations, touches every page, and frees them."""
    activations = torch.ones(WARMUP // 4, dtype=torch.float32)
    assert float(activations[-1]) == 1.0
    del activations


NEXT_START = """
import json, sys
from planners.config import load_config
from planners.report import report_dict
from planners.startup import plan_loaded
from tests.planners.conftest import mapped_module
config = load_config(sys.argv[1], environ={})
plan = plan_loaded(config, {"dit": mapped_module(sys.argv[2])})
print(json.dumps(report_dict(plan)["budget"]))
"""


def test_a_warmup_measures_the_reserve_and_the_next_start_plans_with_it(deployment):
    write, modules, tmp_path = deployment
    config = write("measured")
    assert config.host.reserve == 32 * MiB and "no warmup yet" in config.host.reserve_source

    measured, record = measure_reserve(config, one_request)

    assert abs(record.growth_bytes - WARMUP) <= 0.05 * WARMUP, record
    assert measured.host.reserve == record.growth_bytes and "a warmup grew" in measured.host.reserve_source
    assert remembered(config) == record
    with open(record_path(config)) as handle:
        assert json.load(handle)["growth_bytes"] == record.growth_bytes
    plan = plan_loaded(measured, modules)
    assert plan.budget.reserve == record.growth_bytes  # a live plan under the measured reserve
    assert plan.budget.process_excess > 0  # the process's own memory, beyond the weights, counted live

    done = run_python(NEXT_START, str(tmp_path / "deploy.yaml"), str(tmp_path / "dit"), cwd=REPO)

    assert done.returncode == 0, done.stderr
    budget = json.loads(done.stdout.strip().splitlines()[-1])
    assert budget["reserve_bytes"] == record.growth_bytes
    assert budget["reserve_source"].startswith("measured: a warmup grew") and record.measured_at in budget["reserve_source"]
    text = report_text(plan_loaded(write("measured"), modules))
    assert "measured: a warmup grew" in text and "floor 32.0 MiB; measured stands" in text, text


def test_a_warmup_below_the_floor_gives_the_floor_and_says_so(deployment):
    write, modules, _ = deployment
    config, record = measure_reserve(write("measured"), lambda: None)
    assert record.growth_bytes < 32 * MiB and config.host.reserve == 32 * MiB
    assert "the floor stands" in report_text(plan_loaded(write("measured"), modules))


def test_a_configured_reserve_wins_and_is_not_measured(deployment):
    write, modules, _ = deployment
    measure_reserve(write("measured"), one_request)
    config = write("3GiB")

    same, record = measure_reserve(config, one_request)

    assert record is None and same is config and config.host.reserve == 3 * 1024 * MiB
    assert report_dict(plan_loaded(config, modules))["budget"]["reserve_source"] == "config"


def test_a_damaged_or_foreign_record_is_ignored_and_the_floor_stands(deployment):
    write, _, _ = deployment
    config, _ = measure_reserve(write("measured"), one_request)
    path = record_path(config)
    with open(path, "w") as handle:
        handle.write("{not json")
    again = write("measured")
    assert again.host.reserve == 32 * MiB and "no warmup yet" in again.host.reserve_source
    os.unlink(path)
    os.symlink(os.path.join(os.path.dirname(path), "elsewhere.json"), path)  # a link is never followed
    assert remembered(again) is None


def test_the_override_variable_may_ask_for_a_measured_reserve(deployment):
    write, _, tmp_path = deployment
    write("3GiB")
    config = load_config(tmp_path / "deploy.yaml", environ={"HOSTMEM_HOST_RESERVE": "measured"})
    assert config.host.reserve == 32 * MiB and config.host.reserve_source.startswith("measured")
    plain = load_config(tmp_path / "deploy.yaml", environ={"HOSTMEM_HOST_RESERVE": "2GiB"})
    assert plain.host.reserve == 2 * 1024 * MiB and plain.host.reserve_source == "HOSTMEM_HOST_RESERVE"


def test_a_floor_not_below_the_limit_is_refused_where_it_is_written(deployment):
    from planners.config import ConfigError

    _, _, tmp_path = deployment
    (tmp_path / "deploy.yaml").write_text(CONFIG.format(reserve="measured").replace("32MiB", "7GiB").lstrip())
    with pytest.raises(ConfigError, match=r"host.reserve_floor.*not below host.limit"):
        load_config(tmp_path / "deploy.yaml", environ={})
