"""``hostmem plan`` by path with files only diffusers' converters map onto a diffusers model.

lightx2v's Wan files with the original checkpoint's names and ai-toolkit's MiniMax-H3 files
(``qkv_proj``, which diffusers splits into ``to_q/k/v``) name no weight of the diffusers
model as they stand: the plan must read them as the merge does, through the model class's
converter, and once a merge has recorded the conversion under the cache root, from that
record without torch. Both plans must name the weights ``lora_cache.load_lora`` changes,
with the bytes its stats count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("diffusers", reason="diffusers' converters are what these files need (pip install hostmem[test])")

from lora_cache.targets.planned_conversion import RECORD_FORMAT, RECORD_VERSION  # noqa: E402
from lora_cache.provider import target_layers  # noqa: E402
from planners.checkpoint import checkpoint_files, diffusers_class  # noqa: E402
from tests.conformance.corpus import CASES  # noqa: E402
from tests.conformance.models import load_model, save_model  # noqa: E402

LAYERS = {"wan": "blocks.{i}.", "h3": "transformer_blocks.{i}.", "flux": "transformer_blocks.{i}."}  # the tiny models' block prefixes
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = r"""
import json, sys
from planners.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print(json.dumps({"exit": code, "torch": "torch" in sys.modules, "diffusers": "diffusers" in sys.modules}),
      file=sys.stderr)
"""


def _deployment(tmp_path, case_name: str) -> tuple[str, dict, str, str]:
    """``(config, adapter spec, model folder, cache root)``: a tiny diffusers model saved by
    diffusers, the corpus's file for it, a config that gives the model by path."""
    case = next(c for c in CASES if c.name == case_name)
    model = save_model(case.kind, tmp_path / "dit")
    spec = {"path": case.write(str(tmp_path), model), **case.spec}
    config = tmp_path / "deploy.yaml"
    config.write_text(
        "deployment: t\nhost: {limit: 64MiB, reserve: 8MiB}\nworkload: {steps: 4}\n"
        f"components:\n  dit: {{path: dit, layers: {LAYERS[case.kind]!r}, offload: layerwise}}\n"
        f"lora: {{adapters: [{json.dumps(spec)}], cache: {{root: cache}}}}\n"
    )
    return str(config), spec, model, str(tmp_path / "cache")


def _plan(config: str) -> tuple[dict, dict]:
    out = subprocess.run([sys.executable, "-c", PROBE, "plan", config, "--what-if", "in-place", "--json"],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    probe = json.loads(out.stderr.strip().splitlines()[-1])
    assert probe["exit"] == 0, out.stderr
    return json.loads(out.stdout), probe


def _merged(kind_folder: str, kind: str, spec: dict, root: str) -> tuple[set[str], object]:
    """The weights ``lora_cache.load_lora`` changes in the model, and its stats."""
    import lora_cache

    model = load_model(kind, kind_folder)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    stats = lora_cache.load_lora(model, spec, cache_root=root)
    changed = {name for name, value in model.state_dict().items() if not torch.equal(value, before[name])}
    return changed, stats


@pytest.mark.parametrize("case_name", ["wan-lightx2v-alpha-override", "h3-ai-toolkit-header-alpha", "flux-xlabs"])
def test_plan_reads_converter_only_files_as_the_merge_does(tmp_path, case_name):
    config, spec, model, root = _deployment(tmp_path, case_name)
    kind = next(c for c in CASES if c.name == case_name).kind
    shards = checkpoint_files(model)
    assert diffusers_class(model) == load_model(kind, model).__class__.__name__

    converted = target_layers(shards, [spec], model_class=diffusers_class(model), memo_roots=[root])
    assert "converter" in converted.converted and converted.read_with_torch  # no record yet: diffusers converts
    first, probe = _plan(config)
    assert probe["torch"] and any("converter" in w for w in first["warnings"])

    changed, stats = _merged(model, kind, spec, root)  # records the conversion under the root
    assert set(converted.names) == changed and len(changed) == stats.layers > 0
    assert converted.nbytes == stats.bytes == first["components"]["dit"]["lora_target_bytes"]

    recorded = target_layers(shards, [spec], model_class=diffusers_class(model), memo_roots=[root])
    assert recorded.names == converted.names and recorded.nbytes == converted.nbytes
    assert "conversion records" in recorded.converted and recorded.read_with_torch is None
    second, probe = _plan(config)
    assert not probe["torch"] and not probe["diffusers"]  # the record alone: neither is imported
    assert second["components"]["dit"]["lora_target_bytes"] == stats.bytes


def test_a_record_of_other_content_or_of_a_link_is_no_record(tmp_path):
    config, spec, model, root = _deployment(tmp_path, "wan-lightx2v-alpha-override")
    _merged(model, "wan", spec, root)
    folder = os.path.join(root, "lora_merge_cache", "conversions")
    (name,) = [n for n in os.listdir(folder) if not n.startswith("meaning-")]  # the conversion's record (a
    # meaning record beside it is written or not as this process met the adapter before)
    record = json.load(open(os.path.join(folder, name)))
    assert (record["format"], record["version"]) == (RECORD_FORMAT, RECORD_VERSION)  # what conversion_memo writes
    shards, cls = checkpoint_files(model), diffusers_class(model)

    os.rename(os.path.join(folder, name), tmp_path / "moved.json")
    os.symlink(tmp_path / "moved.json", os.path.join(folder, name))  # a link is never read
    assert "converter" in target_layers(shards, [spec], model_class=cls, memo_roots=[root]).converted
    os.unlink(os.path.join(folder, name))
    record["digest"] = "0" * 64  # another file's conversion
    with open(os.path.join(folder, name), "w") as handle:
        json.dump(record, handle)
    os.chmod(os.path.join(folder, name), 0o600)
    assert "converter" in target_layers(shards, [spec], model_class=cls, memo_roots=[root]).converted


def test_without_a_diffusers_config_the_plan_refuses_as_before(tmp_path):
    config, spec, model, root = _deployment(tmp_path, "wan-lightx2v-alpha-override")
    os.remove(os.path.join(model, "config.json"))
    assert diffusers_class(model) is None
    out = subprocess.run([sys.executable, "-m", "planners.cli", "plan", config], capture_output=True, text=True,
                         cwd=REPO, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "match no module" in out.stderr, out.stderr
