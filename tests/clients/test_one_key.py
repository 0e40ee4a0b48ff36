"""One key per meaning: ``hostmem lora merge CONFIG`` (this package's reader, on the
checkpoint), ``lora_cache.load_lora(pipe)`` (diffusers' converter, the layers named within a
pipeline's component) and ``lora_cache.set_adapters`` on the same base, adapter and
strength share one combination: an image built ahead of time serves a diffusers server."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("diffusers", reason="the diffusers comparisons need diffusers (pip install hostmem[test])")
pytest.importorskip("peft", reason="the diffusers comparisons need peft (pip install hostmem[test])")

from tests.clients import tiny_models as tm  # noqa: E402
from tests.conftest import run_python  # noqa: E402

START = """
import json, sys
import lora_cache
from tests.clients import tiny_models as tm
import torch

model = tm.load_model("flux", sys.argv[1], torch.bfloat16)
pipe = tm.pipeline("flux", model)
stats = lora_cache.load_lora(pipe, sys.argv[2], 0.8, cache_root=sys.argv[3], progress=False)
switched = tm.load_model("flux", sys.argv[1], torch.bfloat16)  # a server that switches adapters
switch = lora_cache.set_adapters(switched, [(sys.argv[2], 0.8)], sys.argv[3])
same = all(torch.equal(a, b) for a, b in zip(tm.weights(model).values(), tm.weights(switched).values()))
print(json.dumps({**stats.to_dict(), "switch": switch.mode, "switch_layers": switch.layers, "same": same}))
"""


def _config(tmp_path, model: str, adapter: str) -> str:
    path = tmp_path / "deploy.yaml"
    path.write_text(f"""
deployment: one-key
host: {{limit: 8GiB, reserve: 1GiB}}
workload: {{steps: 4}}
components:
  dit: {{path: {model}, offload: layerwise, layers: "transformer_blocks.{{i}}."}}
lora:
  adapters: [{{path: {adapter}, strength: 0.8}}]
  cache: {{root: {tmp_path / 'cache'}, enabled: true}}
""")
    return str(path)


def _files(root) -> dict[str, int]:
    return {os.path.join(d, f): os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(root) for f in names}


@pytest.mark.parametrize("layout", ["diffusers_meta", "peft"])
def test_an_image_built_by_the_cli_serves_a_diffusers_pipeline(tmp_path, layout):
    model = tm.save_model("flux", tmp_path / "model", torch.bfloat16)
    written = tm.write_adapters("flux", model, tmp_path / "adapters")[layout]
    adapter = written if layout == "peft" else os.path.join(written, "pytorch_lora_weights.safetensors")
    cli = subprocess.run([sys.executable, "-m", "planners.cli", "lora", "merge", _config(tmp_path, model, adapter),
                          "--json"], capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    built = json.loads(cli.stdout)
    assert built["built"] == built["layers"] > 0
    before = _files(tmp_path / "cache")
    start = run_python(START, model, adapter, str(tmp_path / "cache"), timeout=300)
    assert start.returncode == 0, start.stderr
    served = json.loads(start.stdout.splitlines()[-1])
    assert served["cache_key"] == built["cache_key"]
    assert (served["hit"], served["built"], served["bytes_written"]) == (built["layers"], 0, 0)
    assert (served["switch"], served["switch_layers"], served["same"]) == ("cached", built["layers"], True)
    after = _files(tmp_path / "cache")
    changed = {p for p in after if before.get(p) != after[p]} | (before.keys() - after.keys())
    # nothing of the combination is written; only the record of diffusers' conversion is new
    assert all(os.sep + "conversions" + os.sep in p for p in changed), changed
