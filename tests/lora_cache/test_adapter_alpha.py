"""Alpha from every place an adapter stores it, its precedence, and the folders trainers write."""

from __future__ import annotations

import json
import os

import pytest
import torch

from hostmem.safetensors.mapping import save_file
from lora_cache import Adapter, AdapterError, read_adapter
from lora_cache.orchestrate import plan_targets
from tests.lora_cache.test_adapters import adapter_key, lora_change, mapped_model, write_adapter


def _scales(model, adapters) -> dict[str, float]:
    targets, _ = plan_targets(model, adapters)
    return {t.name: t.deltas[0].scale for t in targets}


def _diffusers_file(path, changes: dict[str, dict], metadata: dict | None = None, prefix="transformer") -> str:
    """A file as diffusers' save_lora_weights writes it: prefixed peft keys, metadata per component."""
    tensors = {}
    for module, parts in changes.items():
        tensors[f"{prefix}.{module}.lora_A.weight"] = parts["down"]
        tensors[f"{prefix}.{module}.lora_B.weight"] = parts["up"]
    header = {"format": "pt"}
    if metadata is not None:
        header["lora_adapter_metadata"] = json.dumps({f"{prefix}.{k}": v for k, v in metadata.items()})
    os.makedirs(os.path.dirname(os.fspath(path)), exist_ok=True)
    save_file(tensors, path, metadata=header)
    return os.fspath(path)


def test_diffusers_metadata_alpha_sets_the_scale(tmp_path):
    """The silent half-delta of issue 15: lora_alpha 16 at r 8 is scale 2, not 1."""
    model = mapped_model(tmp_path)
    changes = {"blocks.0.attn.to_q": lora_change(64, 64, 8, 1), "blocks.0.attn.to_k": lora_change(64, 64, 8, 2)}
    meta = {"r": 8, "lora_alpha": 16, "alpha_pattern": {"to_k": 4}, "rank_pattern": {}}
    with_meta = _diffusers_file(tmp_path / "meta" / "pytorch_lora_weights.safetensors", changes, meta)
    without = _diffusers_file(tmp_path / "plain" / "pytorch_lora_weights.safetensors", changes)
    assert read_adapter(with_meta).format == "diffusers"
    assert _scales(model, [with_meta]) == {
        "blocks.0.attn.to_q.weight": pytest.approx(2.0), "blocks.0.attn.to_k.weight": pytest.approx(0.5),
    }
    assert _scales(model, [without]) == {
        "blocks.0.attn.to_q.weight": pytest.approx(1.0), "blocks.0.attn.to_k.weight": pytest.approx(1.0),
    }


def test_one_components_metadata_is_never_another_components(tmp_path):
    """diffusers' save_lora_weights writes metadata per component: a file whose header holds
    the text encoder's alone (lora_alpha 32 at r 8) leaves the transformer at alpha = r."""
    model = mapped_model(tmp_path)
    changes = {"blocks.0.attn.to_q": lora_change(64, 64, 8, 1)}
    def written(name: str, prefix: str, component: str) -> str:
        path = os.fspath(tmp_path / name)
        save_file({f"{prefix}blocks.0.attn.to_q.lora_{ab}.weight": changes["blocks.0.attn.to_q"][part]
                   for ab, part in (("A", "down"), ("B", "up"))}, path, metadata={
                       "format": "pt", "lora_adapter_metadata": json.dumps(
                           {f"{component}.r": 8, f"{component}.lora_alpha": 32})})
        return path

    other = written("te-meta.safetensors", "transformer.", "text_encoder")
    assert _scales(model, [other]) == {"blocks.0.attn.to_q.weight": pytest.approx(1.0)}
    unprefixed = written("bare.safetensors", "", "transformer")  # one group, its stems without the prefix
    assert _scales(model, [unprefixed]) == {"blocks.0.attn.to_q.weight": pytest.approx(4.0)}


def test_an_adapter_for_weights_stored_transposed_is_refused(tmp_path):
    """peft's fan_in_fan_out (transformers' Conv1D stores a weight as (in, out)): peft merges
    its update transposed; a square weight would take it untransposed without a word."""
    model = mapped_model(tmp_path)
    changes = {"blocks.0.attn.to_q": lora_change(64, 64, 8, 1)}
    folder = write_adapter(tmp_path / "peft", "peft", changes, config={"fan_in_fan_out": True})
    with pytest.raises(AdapterError, match=r"adapter_config.json: fan_in_fan_out is set.*merge_and_unload"):
        _scales(model, [folder])


def test_the_folders_peft_and_diffusers_write_are_read(tmp_path):
    changes = {"blocks.0.attn.to_q": lora_change(64, 64, 8, 1)}
    folder = tmp_path / "diffusers"
    _diffusers_file(folder / "pytorch_lora_weights.safetensors", changes, {"r": 8, "lora_alpha": 8})
    assert read_adapter(folder).path == os.fspath(folder / "pytorch_lora_weights.safetensors")
    peft = write_adapter(tmp_path / "peft", "peft", changes)
    assert read_adapter(peft).path.endswith("adapter_model.safetensors")
    lone = tmp_path / "lone"
    write_adapter(lone / "style_v2.safetensors", "kohya", changes)
    assert read_adapter(lone).path.endswith("style_v2.safetensors")
    write_adapter(lone / "style_v3.safetensors", "kohya", changes)
    with pytest.raises(AdapterError, match=r"lone: a folder without .* it holds style_v2.safetensors, style_v3"):
        read_adapter(lone)


@pytest.mark.parametrize("network_alpha", ["8.0", "1", "Dynamic"])
def test_kohya_ss_network_alpha_is_a_record_never_an_alpha(tmp_path, network_alpha):
    """kohya's create_network_from_weights, diffusers and ComfyUI all take a module without
    ``.alpha`` at alpha = rank, whatever ``ss_network_alpha`` says (``Dynamic`` after
    resize_lora.py's dynamic ranks)."""
    model = mapped_model(tmp_path)
    tensors = {}
    for module, alpha in (("blocks.0.attn.to_q", None), ("blocks.0.attn.to_k", 2.0)):
        parts = lora_change(64, 64, 4, 1, alpha=alpha)
        tensors.update({adapter_key("kohya", module, role): t for role, t in parts.items()})
    path = tmp_path / "k.safetensors"
    save_file(tensors, path, metadata={"ss_network_alpha": network_alpha, "ss_network_dim": "4"})
    assert _scales(model, [os.fspath(path)]) == {
        "blocks.0.attn.to_q.weight": pytest.approx(1.0),  # alpha = rank
        "blocks.0.attn.to_k.weight": pytest.approx(2 / 4),  # its own .alpha
    }


def test_two_stored_alphas_that_disagree_name_both_and_an_override_settles_it(tmp_path):
    model = mapped_model(tmp_path)
    parts = lora_change(64, 64, 8, 1, alpha=4)
    tensors = {f"transformer.blocks.0.attn.to_q.{s}": parts[r]
               for r, s in (("down", "lora_A.weight"), ("up", "lora_B.weight"), ("alpha", "alpha"))}
    path = tmp_path / "both.safetensors"
    save_file(tensors, path, metadata={"lora_adapter_metadata": json.dumps({"transformer.lora_alpha": 16})})
    expected = (r"module 'transformer.blocks.0.attn.to_q' has alpha 4 from 'transformer.blocks.0.attn.to_q.alpha' "
                r"but 16 from lora_adapter_metadata 'transformer' lora_alpha")
    with pytest.raises(AdapterError, match=expected):
        plan_targets(model, [os.fspath(path)])
    assert _scales(model, [Adapter(path, alpha=16)]) == {"blocks.0.attn.to_q.weight": pytest.approx(2.0)}


def test_peft_config_and_metadata_that_agree_are_fine(tmp_path):
    """Sources that state the same alpha (fp16 rounding aside) do not conflict."""
    model = mapped_model(tmp_path)
    parts = lora_change(64, 64, 8, 1, alpha=0.1)
    parts["alpha"] = parts["alpha"].half()
    folder = write_adapter(tmp_path / "peft", "peft", {"blocks.0.attn.to_q": parts}, config={"lora_alpha": 0.1})
    assert _scales(model, [folder]) == {"blocks.0.attn.to_q.weight": pytest.approx(0.1 / 8, rel=1e-3)}


def test_rank_that_contradicts_diffusers_metadata_is_an_error(tmp_path):
    model = mapped_model(tmp_path)
    path = _diffusers_file(tmp_path / "d" / "a.safetensors", {"blocks.0.attn.to_q": lora_change(64, 64, 4, 1)},
                           {"r": 8, "lora_alpha": 8})
    with pytest.raises(AdapterError, match=r"has rank 4 but lora_adapter_metadata 'transformer' says r=8"):
        plan_targets(model, [path])


@pytest.mark.parametrize("meta, message", [
    ("{not json", "is not JSON"),
    (json.dumps({"transformer.lora_alpha": "sixteen"}), "lora_alpha is 'sixteen'; expected a finite number"),
    (json.dumps({"transformer.r": 0}), "r is 0; expected a positive whole number"),
])
def test_broken_metadata_says_where(tmp_path, meta, message):
    parts = lora_change(8, 8, 2, 1)
    path = tmp_path / "m.safetensors"
    save_file({"transformer.x.lora_A.weight": parts["down"], "transformer.x.lora_B.weight": parts["up"]}, path,
              metadata={"lora_adapter_metadata": meta})
    with pytest.raises(AdapterError, match=rf"m.safetensors: header metadata 'lora_adapter_metadata'.*{message}"):
        read_adapter(path)


def test_asking_for_diffusers_conversion_on_another_model_is_an_error(tmp_path):
    model = mapped_model(tmp_path)
    path = write_adapter(tmp_path / "k.safetensors", "kohya", {"blocks.0.attn.to_q": lora_change(64, 64, 4, 1)})
    with pytest.raises(AdapterError, match=r"k.safetensors: convert='diffusers' but the model is not one diffusers"):
        plan_targets(model, [Adapter(path, convert="diffusers")])
    assert _scales(model, [Adapter(path, convert="auto")]) == {"blocks.0.attn.to_q.weight": pytest.approx(1.0)}


def _ai_toolkit(path, header: dict, alpha=None) -> str:
    """ai-toolkit's layout: ``diffusion_model.<module>.lora_A/B.weight``, the alpha in the header."""
    parts = lora_change(64, 64, 8, 1, alpha=alpha)
    tensors = {"diffusion_model.blocks.0.attn.to_q.lora_A.weight": parts["down"],
               "diffusion_model.blocks.0.attn.to_q.lora_B.weight": parts["up"]}
    if alpha is not None:
        tensors["diffusion_model.blocks.0.attn.to_q.alpha"] = parts["alpha"]
    save_file(tensors, path, metadata=header)
    return os.fspath(path)


@pytest.mark.parametrize("entry", ["alpha", "lora_alpha", "network_alpha"])
def test_a_header_alpha_entry_sets_the_scale(tmp_path, entry):
    """lightx2v's H3 Turbo files: ``{"alpha": "4"}`` at rank 8 is scale 0.5, not 1."""
    model = mapped_model(tmp_path)
    path = _ai_toolkit(tmp_path / "h.safetensors", {entry: "4"})
    assert _scales(model, [path]) == {"blocks.0.attn.to_q.weight": pytest.approx(0.5)}
    assert _scales(model, [Adapter(path, alpha=16)]) == {"blocks.0.attn.to_q.weight": pytest.approx(2.0)}


@pytest.mark.parametrize("header, alpha, message", [
    ({"alpha": "4"}, 2.0, r"has alpha 2 from 'diffusion_model.blocks.0.attn.to_q.alpha' but 4 from header "
                          r"metadata 'alpha'"),
    ({"alpha": "4", "network_alpha": "8"}, None, r"header metadata alpha=4 but network_alpha=8"),
    ({"alpha": "four"}, None, r"header metadata alpha='four' is not a number"),
])
def test_header_alphas_that_disagree_name_both(tmp_path, header, alpha, message):
    model = mapped_model(tmp_path)
    path = _ai_toolkit(tmp_path / "h.safetensors", header, alpha=alpha)
    with pytest.raises(AdapterError, match=message):
        plan_targets(model, [path])


def test_a_header_alpha_that_agrees_with_the_module_alpha_is_fine(tmp_path):
    model = mapped_model(tmp_path)
    path = _ai_toolkit(tmp_path / "h.safetensors", {"alpha": "4", "ss_network_alpha": "2.0"}, alpha=4.0)
    assert _scales(model, [path]) == {"blocks.0.attn.to_q.weight": pytest.approx(0.5)}


def test_anchored_peft_patterns_match_as_peft_matches_them(tmp_path):
    """peft strips ``base_model.model.`` before matching, so ``^blocks\\.1\\...`` holds."""
    model = mapped_model(tmp_path)
    changes = {"blocks.0.attn.to_k": lora_change(64, 64, 8, 1), "blocks.1.attn.to_k": lora_change(64, 64, 4, 2),
               "blocks.1.attn.to_q": lora_change(64, 64, 8, 3)}
    config = {"r": 8, "lora_alpha": 8, "alpha_pattern": {r"^blocks\.1\.attn\.to_k": 32, "to_q": 2},
              "rank_pattern": {r"^blocks\.1\.attn\.to_k": 4}}
    folder = write_adapter(tmp_path / "peft", "peft", changes, config=config)
    assert _scales(model, [folder]) == {
        "blocks.0.attn.to_k.weight": pytest.approx(1.0),  # r, lora_alpha
        "blocks.1.attn.to_q.weight": pytest.approx(2 / 8),  # a plain pattern matches the name's end
        "blocks.1.attn.to_k.weight": pytest.approx(32 / 4),  # the anchored patterns
    }
    # an anchored pattern names the module from the start of its name, never a later part of it
    folder = write_adapter(tmp_path / "peft2", "peft", {"blocks.1.attn.to_k": lora_change(64, 64, 8, 2)},
                           config={"r": 8, "lora_alpha": 8, "alpha_pattern": {r"^attn\.to_k": 32}})
    assert _scales(model, [folder]) == {"blocks.1.attn.to_k.weight": pytest.approx(1.0)}


def test_a_peft_config_applies_only_to_the_file_peft_wrote_with_it(tmp_path):
    """An unrelated ``style.safetensors`` beside a peft adapter keeps its own alpha (none)."""
    model = mapped_model(tmp_path)
    changes = {"blocks.0.attn.to_q": lora_change(64, 64, 8, 1)}
    folder = write_adapter(tmp_path / "peft", "peft", changes, config={"lora_alpha": 32})
    style = write_adapter(os.path.join(folder, "style.safetensors"), "kohya", changes)
    assert _scales(model, [folder]) == {"blocks.0.attn.to_q.weight": pytest.approx(4.0)}
    assert _scales(model, [style]) == {"blocks.0.attn.to_q.weight": pytest.approx(1.0)}


def test_each_scale_says_where_its_alpha_was_read_from(tmp_path):
    """The canonical form records a scale's origin: the place the precedence picked."""
    path = _ai_toolkit(tmp_path / "h.safetensors", {"alpha": "4"})
    adapter = read_adapter(path)
    change = next(iter(adapter.modules.values()))
    assert adapter.alpha_from(change) == (4.0, "header metadata 'alpha'")
    assert adapter.alpha_from(change, 2.0) == (2.0, "Adapter(alpha=...)")
    plain = read_adapter(_ai_toolkit(tmp_path / "p.safetensors", {}))
    assert plain.alpha_from(next(iter(plain.modules.values()))) == (None, "none: alpha = rank")


def test_peft_default_infix_and_xlabs_parts_are_read_as_down_and_up(tmp_path):
    """``.lora_A.default.weight`` (DiffSynth-Studio's peft dump) and ``.down.weight`` /
    ``.up.weight`` (XLabs) are the same parts: the same module, the same scale."""
    model = mapped_model(tmp_path)
    parts = lora_change(64, 64, 8, 1)
    for name, (down, up) in {"default": ("lora_A.default.weight", "lora_B.default.weight"),
                             "xlabs": ("down.weight", "up.weight")}.items():
        path = tmp_path / f"{name}.safetensors"
        save_file({f"blocks.0.attn.to_q.{down}": parts["down"], f"blocks.0.attn.to_q.{up}": parts["up"]}, path,
                  metadata={"lora_alpha": "16"})
        targets, _ = plan_targets(model, [os.fspath(path)])
        assert [(t.name, t.deltas[0].scale) for t in targets] == [("blocks.0.attn.to_q.weight", pytest.approx(2.0))]
        assert torch.equal(targets[0].deltas[0].down, parts["down"])
