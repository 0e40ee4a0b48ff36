"""hostmem.remap(spill=True) on a diffusers Flux transformer after fuse_qkv_projections().

diffusers maps the checkpoint at from_pretrained, then ``fuse_qkv_projections()`` (which
torch.compile recipes call) concatenates q, k and v into new anonymous ``to_qkv`` and
``to_added_qkv`` weights no checkpoint tensor holds. The spill maps them back: (almost)
nothing anonymous is left, the forward pass keeps every bit, the report names the
checkpoint tensors each was fused from, a second process writes nothing, and a LoRA
merged through the cache afterwards gives what it gives on the unspilled model.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import hostmem
from tests.conftest import run_python

pytest.importorskip("diffusers", reason="the fused spill tests load a real diffusers model")

from tests.clients import tiny_models as tm  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fused(folder: str):
    """from_pretrained (mapped), then diffusers' own fusion."""
    model = tm.load_model("flux", folder)
    model.fuse_qkv_projections()
    return model


def start(folder: str, cache_root: str):
    """One start: load, fuse, spill; the model, the report, and whether the output kept every bit."""
    model = fused(folder)
    before = tm.forward(model, "flux")
    report = hostmem.remap(model, spill=True, cache_root=cache_root)
    return model, report, torch.equal(tm.forward(model, "flux"), before)


def _anonymous_share(model) -> float:
    totals = hostmem.account(model).totals
    return totals.anonymous / (totals.anonymous + totals.file_backed + totals.not_resident)


def test_fused_projections_are_spilled_named_and_compute_the_same_bits(tmp_path):
    folder = tm.save_model("flux", tmp_path / "model")
    model = fused(folder)
    assert _anonymous_share(model) > 0.05  # the fused copies: q, k and v again
    assert hostmem.remap(fused(folder)).left_bytes["missing"] > 0  # remap alone cannot give them back

    model, report, equal = start(folder, str(tmp_path / "cache"))

    assert equal and _anonymous_share(model) <= 0.01
    assert report.left_bytes["missing"] == 0 and report.spill_problem is None
    prefix = "transformer_blocks.0.attn."
    assert report.spill_origins[prefix + "to_qkv.weight"] == (
        f"fused from {prefix}to_q.weight, {prefix}to_k.weight, {prefix}to_v.weight")
    assert report.spill_origins[prefix + "to_added_qkv.weight"] == (
        f"fused from {prefix}add_q_proj.weight, {prefix}add_k_proj.weight, {prefix}add_v_proj.weight")
    assert all(o.startswith("fused from ") for o in report.spill_origins.values()), report.spill_origins
    assert "fused" in str(report)


SECOND_START = """
import json, sys
from tests.clients.test_remap_spill_fused import start
model, report, equal = start(sys.argv[1], sys.argv[2])
print(json.dumps({"report": report.to_dict(), "equal": equal}))
"""


def test_a_second_process_writes_nothing(tmp_path):
    folder, root = tm.save_model("flux", tmp_path / "model"), str(tmp_path / "cache")
    _, first, _ = start(folder, root)
    assert first.spill_written_bytes > 0

    done = run_python(SECOND_START, folder, root, cwd=REPO)

    assert done.returncode == 0, done.stderr
    second = json.loads(done.stdout.strip().splitlines()[-1])
    assert second["equal"] and second["report"]["spill_written_bytes"] == 0
    assert second["report"]["spill_reused_bytes"] == first.spill_written_bytes
    assert second["report"]["spill_origins"] == first.spill_origins


def test_a_lora_merged_through_the_cache_after_the_spill_matches_the_unspilled_model(tmp_path):
    pytest.importorskip("peft", reason="the adapter is written by peft")
    import lora_cache

    folder = tm.save_model("flux", tmp_path / "model")
    adapter = tm.write_adapters("flux", folder, tmp_path)["diffusers_meta"]
    reference = fused(folder)
    lora_cache.load_lora(reference, adapter, cache_root=tmp_path / "plain", progress=False)
    expected = tm.forward(reference, "flux")

    model, _, _ = start(folder, str(tmp_path / "cache"))
    base = tm.forward(model, "flux")
    stats = lora_cache.load_lora(model, adapter, cache_root=tmp_path / "cache", progress=False)

    merged = tm.forward(model, "flux")
    assert torch.equal(merged, expected) and not torch.equal(merged, base), stats
    assert _anonymous_share(model) <= 0.01
    lora_cache.unmerge(model)
    assert torch.equal(tm.forward(model, "flux"), base)


def test_adapters_switch_on_the_spilled_model_as_on_the_unspilled_one(tmp_path):
    pytest.importorskip("peft", reason="the adapter is written by peft")
    from lora_cache import set_pipeline_adapters

    folder = tm.save_model("flux", tmp_path / "model")
    files = {"style": tm.write_adapters("flux", folder, tmp_path)["diffusers_meta"]}
    options = {"files": files, "weight_name": "pytorch_lora_weights.safetensors", "background": False}
    reference = fused(folder)
    set_pipeline_adapters(reference, ["style"], [0.5], cache_root=tmp_path / "plain", **options)
    expected = tm.forward(reference, "flux")

    model, _, _ = start(folder, str(tmp_path / "cache"))
    base = tm.forward(model, "flux")
    set_pipeline_adapters(model, ["style"], [0.5], cache_root=tmp_path / "cache", **options)
    assert torch.equal(tm.forward(model, "flux"), expected) and not torch.equal(expected, base)
    assert _anonymous_share(model) <= 0.01

    set_pipeline_adapters(model, [], cache_root=tmp_path / "cache", **options)
    assert torch.equal(tm.forward(model, "flux"), base)
