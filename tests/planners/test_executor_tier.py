"""The plan's disk tier under the executor: `hostmem plan`'s text and JSON say what it reads.

A layerwise component whose unpinned blocks do not fit in page cache reads, per the
pin plan alone, every one of them on every move (the kernel's LRU). The executor keeps
a fixed set and reads the rest, so the report's disk figure is the executor's: the
released blocks times the moves per request, the same in the text, the JSON and the
page-cache line.
"""

from __future__ import annotations

import json
import os

import torch

from hostmem.units import format_size
from planners.cli import main
from planners.executor import plan_roles
from planners.executor.synthetic import write_synthetic_dit

from .conftest import MiB

LAYERS, STEPS = 16, 4  # blocks of 1 MiB (512 x 512 fp32)


def _config(tmp_path, room: int) -> str:
    checkpoint = write_synthetic_dit(tmp_path / "dit.safetensors", LAYERS, 512, torch.float32)
    reserve = 64 * MiB
    text = (
        "deployment: tier\n"
        f"host: {{limit: {reserve + room}B, reserve: {reserve}B, max_pinned: 0B}}\n"
        f"workload: {{steps: {STEPS}}}\n"
        "components:\n"
        f"  dit: {{path: {json.dumps(os.fspath(checkpoint))}, layers: \"blocks.{{i}}.\", offload: layerwise}}\n"
    )
    path = tmp_path / "tier.yaml"
    path.write_text(text)
    return os.fspath(path)


def _roles(path: str):
    """The executor's roles on the plan `hostmem plan` makes of ``path`` (what-if, no merge)."""
    from planners.budget import read_host_limit
    from planners.config import load_config
    from planners.deployment import plan_deployment
    from planners.whatif import checkpoint_sizes, what_if_components

    config = load_config(path)
    components, _ = what_if_components(config, "none", checkpoint_sizes(config))
    plan = plan_deployment(config, components, read_host_limit(config))
    return plan_roles(plan, config.streamed.prefetch)["dit"]


def _report(capsys, config: str) -> tuple[str, dict]:
    assert main(["plan", config]) == 0
    text = capsys.readouterr().out
    assert main(["plan", config, "--json"]) == 0
    return text, json.loads(capsys.readouterr().out)


def test_disk_figure_is_the_executors_in_text_and_json(tmp_path, capsys):
    config = _config(tmp_path, room=8 * MiB)  # half the model's blocks fit in page cache
    text, report = _report(capsys, config)
    pins = report["pin_plans"]["dit"]
    assert not pins["page_cache_fits"]
    disk = pins["disk_bytes_per_request"]
    every_block = STEPS * pins["page_cache_bytes"]  # what the kernel's LRU would read
    assert 0 < disk < every_block
    roles = _roles(config)
    assert roles.kept and roles.released
    assert disk == STEPS * roles.predicted_read_bytes == STEPS * len(roles.released) * MiB
    row = next(line for line in text.splitlines() if line.strip().startswith("dit ") and "of" in line)
    assert format_size(disk) in row and format_size(every_block) not in row
    line = next(line for line in text.splitlines() if f"dit reads {format_size(disk)} from disk per request" in line)
    assert f"keeps {len(roles.kept)} of {len(roles.kept) + len(roles.released)} in page cache" in line
    assert f"reads {format_size(disk)} from disk" in text  # the warnings line sums the same figure


def test_a_model_that_fits_in_page_cache_reads_nothing(tmp_path, capsys):
    text, report = _report(capsys, _config(tmp_path, room=64 * MiB))
    assert report["pin_plans"]["dit"]["page_cache_fits"] and report["pin_plans"]["dit"]["disk_bytes_per_request"] == 0
    assert "from disk per request" not in text
