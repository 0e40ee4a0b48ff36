"""``hostmem plan`` by path with adapters and no ``lora_targets``: no torch, same figures.

The plan reads the adapters' headers (lora_cache.targets.header_targets); the same config
planned with the merge's own reader (imports torch) must give the same report, figure
for figure, and that run says in a warning that it read the targets with torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from tests.conftest import write_safetensors
from tests.lora_cache.test_adapters import lora_change, write_adapter

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = r"""
import json, sys
if sys.argv[1] == "reader":  # the merge's own reader: the header path hands every adapter to it
    import lora_cache.provider as provider
    from lora_cache.targets.header_targets import NeedsReader
    def refuse(adapters, shapes):
        raise NeedsReader("read with the reader for the comparison")
    provider.header_targets = refuse
from planners.cli import main
try:
    code = main(sys.argv[2:])
except SystemExit as exc:
    code = exc.code
print(json.dumps({"exit": code, "torch": "torch" in sys.modules}), file=sys.stderr)
"""


def _deployment(tmp_path) -> str:
    """A 12-block checkpoint of 1 MiB weights, a kohya and a ComfyUI adapter and a peft folder,
    a config by path."""
    tensors = {f"blocks.{i}.{w}.weight": torch.zeros(512, 1024, dtype=torch.bfloat16)
               for i in range(12) for w in ("attn", "mlp")}
    write_safetensors(tmp_path / "dit" / "model.safetensors", tensors)
    write_adapter(tmp_path / "style.safetensors", "kohya",
                  {f"blocks.{i}.attn": lora_change(512, 1024, 4, i) for i in range(0, 12, 2)})
    write_adapter(tmp_path / "turbo.safetensors", "comfyui",
                  {f"blocks.{i}.mlp": lora_change(512, 1024, 4, i) for i in range(3)})
    write_adapter(tmp_path / "detail", "peft", {f"blocks.{i}.mlp": lora_change(512, 1024, 4, i) for i in (3, 4)})
    config = tmp_path / "deploy.yaml"
    config.write_text(
        "deployment: t\nhost: {limit: 64MiB, reserve: 8MiB}\nworkload: {steps: 4}\n"
        "components:\n  dit: {path: dit, layers: \"blocks.{i}.\", offload: layerwise}\n"
        "lora: {adapters: [{path: style.safetensors}, {path: turbo.safetensors, strength: 0.5}, {path: detail}],"
        " cache: {root: cache}}\n"
    )
    return str(config)


def _plan(how: str, *argv: str) -> tuple[dict, bool]:
    out = subprocess.run([sys.executable, "-c", PROBE, how, "plan", *argv, "--json"], capture_output=True,
                         text=True, cwd=REPO, timeout=120)
    probe = json.loads(out.stderr.strip().splitlines()[-1])
    assert probe["exit"] == 0, out.stderr
    return json.loads(out.stdout), probe["torch"]


def test_plan_by_path_with_adapters_reads_headers_without_torch_and_agrees_with_the_reader(tmp_path):
    config = _deployment(tmp_path)
    for merge in ("in-place", "cached"):
        fast, fast_torch = _plan("headers", config, "--what-if", merge)
        slow, slow_torch = _plan("reader", config, "--what-if", merge)
        assert (fast_torch, slow_torch) == (False, True)
        said = [w for w in slow.pop("warnings") if "read with torch" in w]
        assert said and "the same figures" in said[0]
        assert not any("read with torch" in w for w in fast.pop("warnings"))
        assert fast == slow
    plan, _ = _plan("headers", config, "--what-if", "in-place")
    # 6 attn + 5 mlp weights of 1 MiB: the targets the three adapters name, merged in place
    assert plan["components"]["dit"]["lora_target_bytes"] == 11 * 1024 * 1024
    assert plan["budget"]["committed_bytes"] == 11 * 1024 * 1024
