"""LoRA targets from the adapters' headers: `--what-if in-place` predicts what the merge commits.

The config names the DiT by path and lists the adapter, but declares no lora_targets.
The plan (a subprocess, as a person runs it) reads the targets from the adapter and
checkpoint headers; a real in-place merge (unmergeable: the mapped base is its own
snapshot) then grows the process by what the plan committed, within 5%.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from planners.config import load_config
from planners.whatif import checkpoint_sizes

from .conftest import MiB, write_checkpoint
from .test_whatif_vs_live import grew_as_predicted, in_place_growth, write_adapter

CONFIG = """
deployment: adapter-targets
host: {limit: 2148MiB, reserve: 2GiB, max_pinned: 100%}
device: {vram: 32MiB, reserve: 8MiB}
workload: {steps: 4}
components:
  dit: {path: ckpt/dit, layers: "blocks.{i}.", offload: layerwise, prefetch: 1}
  text_encoder: {path: ckpt/te, layers: "enc.{i}.", offload: full}
lora:
  adapters: [{path: turbo.safetensors, strength: 1.0}]
  cache: {enabled: false}
"""


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapter_targets")
    write_checkpoint(root / "ckpt" / "dit", 24, 5 * MiB, rest_bytes=MiB, files=3, cols=1024)
    write_checkpoint(root / "ckpt" / "te", 4, 8 * MiB, prefix="enc")
    write_adapter(root / "turbo.safetensors", layers=24, rows=1280, cols=1024, rank=4)
    (root / "deploy.yaml").write_text(CONFIG.lstrip())
    return root


def test_targets_are_read_per_layer_from_the_headers(root):
    config = load_config(root / "deploy.yaml", environ={})
    assert config.merge_target.name == "dit" and not config.merge_target.has_lora_targets
    dit = checkpoint_sizes(config)["dit"]
    per_layer = 1280 * 1024 * 2  # every blocks.{i}.w0.weight, bf16
    assert [u.lora_target_bytes for u in dit.layers] == [per_layer] * 24
    assert dit.rest.lora_target_bytes == 0 and dit.lora_target_bytes == 24 * per_layer


def test_what_if_in_place_predicts_what_a_fresh_process_grows_by(root):
    out = subprocess.run(
        [sys.executable, "-m", "planners.cli", "plan", str(root / "deploy.yaml"), "--what-if", "in-place", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert not any("nothing is merged" in w for w in report["warnings"])
    predicted = report["budget"]["committed_bytes"]
    assert predicted == 24 * 1280 * 1024 * 2  # the merged targets: no copy of the mapped base
    child = in_place_growth(root / "ckpt" / "dit", root / "turbo.safetensors")
    assert child["in_place"] == 24 and grew_as_predicted(child["grown"], predicted), (child, predicted)
