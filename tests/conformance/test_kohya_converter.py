"""What diffusers (and peft) do with the corpus files lora_cache refuses or holds to the math:
the kohya files diffusers' ``convert_state_dict_to_kohya`` writes for Flux, SD3,
HunyuanVideo, LTX and ZImage, and layouts its loaders skip (see
:mod:`tests.conformance.corpus_families` for what was found per family).

diffusers' own path (the family's ``lora_state_dict`` of the file, ``load_lora_adapter``,
``fuse_lora``) changes no weight of the model, or raises: so lora_cache's refusal is not a
difference from a library that merges the file, and where lora_cache merges the file's
evident meaning (the kohya names of the model's own keys) it is held to the math. When a
diffusers release starts loading one of them, this test fails and the case moves to the
``diffusers`` reference."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("diffusers", reason="the behaviour held here is diffusers'")
pytest.importorskip("peft", reason="diffusers' LoRA loading needs peft (pip install hostmem[test])")

from tests.conformance import models  # noqa: E402
from tests.conformance.corpus import CASES  # noqa: E402
from tests.conformance.corpus_families import diffusers_outcome  # noqa: E402

_OUTCOME = diffusers_outcome()
_CASES = [c for c in CASES if c.name in _OUTCOME]


def test_every_listed_file_is_a_corpus_case():
    assert {c.name for c in _CASES} == set(_OUTCOME)


@pytest.mark.parametrize("case", _CASES, ids=[c.name for c in _CASES])
def test_diffusers_merges_nothing_of_the_file(case, tmp_path):
    model_folder = models.save_model(case.kind, tmp_path / "model")
    path = case.write(os.fspath(tmp_path), model_folder)
    error = _OUTCOME[case.name]
    if error is not None:
        with pytest.raises(Exception, match=error):
            models.diffusers_fused(case.kind, model_folder, path)
        return
    fused = models.weights(models.diffusers_fused(case.kind, model_folder, path))
    base = models.weights(models.load_model(case.kind, model_folder))
    assert [name for name, weight in fused.items() if not torch.equal(weight, base[name])] == []


def test_peft_refuses_to_merge_a_lora_bias_on_a_layer_without_bias(tmp_path):
    """The corpus refuses this file as peft's own merge does (not a difference from peft)."""
    case = next(c for c in CASES if c.name == "h3-peft-lora-bias-on-a-layer-without-bias")
    model_folder = models.save_model(case.kind, tmp_path / "model")
    path = case.write(os.fspath(tmp_path), model_folder)
    with pytest.warns(UserWarning, match="has no bias"), pytest.raises(Exception, match="Impossible to merge"):
        models.peft_merged(case.kind, model_folder, path)
