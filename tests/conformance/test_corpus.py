"""Every file of the conformance corpus merged by lora_cache and by its reference: equal up to
one rounding, or a refusal whose message names the reason. Not one silent difference."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("diffusers", reason="the conformance corpus needs diffusers (pip install hostmem[test])")
pytest.importorskip("peft", reason="the conformance corpus needs peft (pip install hostmem[test])")

import lora_cache  # noqa: E402
from lora_cache import Adapter  # noqa: E402
from tests.conformance import models  # noqa: E402
from tests.conformance.corpus import CASES, Case  # noqa: E402
from tests.fresh_fork import fresh_call  # noqa: E402


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory):
    """One tiny model of each kind, saved once for the module."""
    root = tmp_path_factory.mktemp("models")
    return {kind: models.save_model(kind, root / kind) for kind in sorted({c.kind for c in CASES})}


def _reference(case: Case, model_folder: str, path: str, folder: str) -> dict[str, torch.Tensor]:
    strength = case.spec.get("strength", 1.0)
    if case.reference == "peft":
        return models.weights(models.peft_merged(case.kind, model_folder, path))
    if case.reference == "diffusers-model":
        return models.weights(models.diffusers_adapter_fused(case.kind, model_folder, path, strength))
    if case.reference == "diffusers-file":
        path = case.reference_write(os.path.join(folder, "reference"), model_folder)
    if case.reference in ("diffusers", "diffusers-file"):
        return models.weights(models.diffusers_fused(case.kind, model_folder, path, strength))
    base = models.weights(models.load_model(case.kind, model_folder))
    return _math(case, base, strength, path)


def _math(case: Case, base: dict, strength: float, path: str) -> dict:
    deltas = case.expected(path)
    return {name: (w.double() + strength * deltas[name].double()).to(w.dtype) if name in deltas else w
            for name, w in base.items()}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_file_merges_as_its_reference_does(case, model_folders, tmp_path):
    model_folder = model_folders[case.kind]
    os.makedirs(tmp_path / "reference")
    path = case.write(os.fspath(tmp_path), model_folder)
    spec = Adapter(path, **case.spec)
    ours = models.load_model(case.kind, model_folder)
    if case.reference == "refused":
        with pytest.raises(Exception, match=case.refusal):
            lora_cache.load_lora(ours, spec, cache_root=tmp_path / "cache", progress=False)
        return
    stats = lora_cache.load_lora(ours, spec, cache_root=tmp_path / "cache", progress=False)
    reference = _reference(case, model_folder, path, os.fspath(tmp_path))
    merged, base = models.weights(ours), models.weights(models.load_model(case.kind, model_folder))
    changed = [n for n, w in reference.items() if not torch.equal(w, base[n])]
    assert changed and stats.built == stats.layers == len(changed)
    for name, ref in reference.items():
        torch.testing.assert_close(merged[name], ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()), msg=name)
    again = models.load_model(case.kind, model_folder)  # a second start: every layer a hit, the same bytes
    hit = lora_cache.load_lora(again, spec, cache_root=tmp_path / "cache", progress=False)
    assert hit.built == 0 and hit.layers == stats.layers
    assert all(torch.equal(w, merged[n]) for n, w in models.weights(again).items())


def test_set_adapters_reads_the_anchored_peft_patterns_as_merge_does(model_folders, tmp_path):
    """set_adapters plans from the same reading: an anchored alpha_pattern counts there too."""
    case = next(c for c in CASES if c.name == "wan-peft-anchored-patterns")
    model_folder = model_folders[case.kind]
    path = case.write(os.fspath(tmp_path), model_folder)
    ours = models.load_model(case.kind, model_folder)
    result = lora_cache.set_adapters(ours, [path], cache_root=tmp_path / "cache", background=False)
    assert result.mode == "built" and result.layers == 8, result
    reference = models.weights(models.peft_merged(case.kind, model_folder, path))
    merged = models.weights(ours)
    for name, ref in reference.items():
        torch.testing.assert_close(merged[name], ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()), msg=name)


_FRESH = ["h3-ai-toolkit-header-alpha", "wan-lightx2v-alpha-override", "wan-comfyui-full-diffs", "unet-peft-conv-dora",
          "wan-lycoris-dora-input-axis", "flux-comfyui-full-diffs"]


@pytest.mark.slow
@pytest.mark.parametrize("name", _FRESH)
def test_a_start_in_a_fresh_process_hits_what_the_first_built(name, model_folders, tmp_path):
    """The reading a first start recorded (alphas folded, full diffs placed) plans a second
    start in another process: every layer a hit, the same bytes."""
    case = next(c for c in CASES if c.name == name)
    os.makedirs(tmp_path / "reference")
    spec = {"path": case.write(os.fspath(tmp_path), model_folders[case.kind]), **case.spec}
    args = (case.kind, os.fspath(model_folders[case.kind]), os.fspath(tmp_path / "cache"), spec)
    runs = [fresh_call(models.start_and_digest, *args) for _ in range(2)]
    first, second = runs
    assert first["built"] == first["layers"] > 0
    assert second["hit"] == second["layers"] == first["layers"] and second["built"] == 0
    assert second["digest"] == first["digest"]
