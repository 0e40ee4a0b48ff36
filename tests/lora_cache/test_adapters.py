"""Adapter files in each format's real key layout, and how their keys resolve.

The helpers here (a small DiT, read-only mapped copies of it, adapter writers per
format, the fp64 reference merge) are shared by the other lora_cache tests.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from torch import nn

from hostmem import load_readonly
from lora_cache import Adapter, AdapterError, KeyResolutionError, UnsupportedAdapterError, read_adapter
from lora_cache.orchestrate import plan_targets
from tests.conftest import write_safetensors

# ----------------------------------------------------------------- shared helpers


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.attn = nn.Module()
        for name in ("to_q", "to_k", "to_v", "to_out"):
            self.attn.add_module(name, nn.Linear(dim, dim))
        self.ff = nn.Module()
        self.ff.proj_in = nn.Linear(dim, 2 * dim)
        self.ff.proj_out = nn.Linear(2 * dim, dim)
        self.norm = nn.LayerNorm(dim)


class TinyDiT(nn.Module):
    """A DiT's naming (blocks.N.attn.to_q, ff.proj_in, a conv patch embedding), tiny."""

    def __init__(self, dim: int = 64, depth: int = 2, channels: int = 4):
        super().__init__()
        self.patch_embed = nn.Conv2d(channels, dim, kernel_size=2, stride=2)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.proj_out = nn.Linear(dim, channels)


def mapped_model(folder, dim=64, depth=2, dtype=torch.float32, seed=0, module=None) -> nn.Module:
    """A model whose every weight is a read-only mapped view of a safetensors file it wrote."""
    torch.manual_seed(seed)
    model = (module or TinyDiT(dim, depth)).to(dtype)
    path = write_safetensors(os.path.join(folder, "base.safetensors"),
                             {k: v.detach() for k, v in model.state_dict().items()})
    mapped = load_readonly(path)
    for name, tensor in mapped.items():
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
    return model


def lora_change(out: int, inp: int, rank: int, seed: int, alpha=None, conv=None) -> dict:
    """A random up/down pair (conv: down carries the kernel, up is 1x1)."""
    gen = torch.Generator().manual_seed(seed)
    down = torch.randn(rank, inp, *(conv or ()), generator=gen) / inp**0.5
    up = torch.randn(out, rank, *((1, 1) if conv else ()), generator=gen)
    change = {"up": up, "down": down}
    if alpha is not None:
        change["alpha"] = torch.tensor(float(alpha))
    return change


_SUFFIXES = {
    "peft": {"down": "lora_A.weight", "up": "lora_B.weight", "alpha": "alpha"},
    "kohya": {"down": "lora_down.weight", "up": "lora_up.weight", "alpha": "alpha"},
    "comfyui": {
        "down": "lora_down.weight", "up": "lora_up.weight", "alpha": "alpha", "diff": "diff", "diff_b": "diff_b",
    },
}


def adapter_key(fmt: str, module: str, role: str, prefix: str | None = None) -> str:
    """The key a trainer of ``fmt`` writes for ``role`` of ``module``."""
    if fmt == "kohya":
        stem = (prefix if prefix is not None else "lora_unet_") + module.replace(".", "_")
    else:
        default = "base_model.model." if fmt == "peft" else "diffusion_model."
        stem = (prefix if prefix is not None else default) + module
    return f"{stem}.{_SUFFIXES[fmt][role]}"


def write_adapter(path, fmt: str, changes: dict[str, dict], prefix: str | None = None, config=None) -> str:
    """Write ``{module: {up, down, alpha, diff, diff_b}}`` in ``fmt``'s layout; return the path.

    peft writes ``adapter_model.safetensors`` plus ``adapter_config.json`` in the folder
    ``path`` (as save_pretrained does) and returns the folder.
    """
    tensors = {adapter_key(fmt, m, role, prefix): t for m, parts in changes.items() for role, t in parts.items()}
    if fmt != "peft":
        return write_safetensors(path, tensors)
    os.makedirs(path, exist_ok=True)
    write_safetensors(os.path.join(path, "adapter_model.safetensors"), tensors)
    ranks = {m: p["down"].shape[0] for m, p in changes.items() if "down" in p}
    r = max(ranks.values(), key=list(ranks.values()).count, default=8)
    full = {
        "peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": sorted(changes),
        "rank_pattern": {re.escape(m): k for m, k in ranks.items() if k != r}, "alpha_pattern": {},
        "use_rslora": False, "use_dora": False, "bias": "none",
        "lora_dropout": 0.0, "fan_in_fan_out": False, "inference_mode": True, "task_type": None,
        "base_model_name_or_path": None, "modules_to_save": None, "init_lora_weights": True,
    }
    full.update(config or {})
    with open(os.path.join(path, "adapter_config.json"), "w") as handle:
        json.dump(full, handle)
    return path


def reference_merge(base: torch.Tensor, terms: list[tuple[float, dict]]) -> torch.Tensor:
    """base + sum(scale * up @ down + strength * diff) in fp64: the independent answer."""
    acc = base.double().clone()
    for scale, parts in terms:
        if "up" in parts:
            up, down = parts["up"].double().flatten(1), parts["down"].double().flatten(1)
            acc += (scale * (up @ down)).reshape(acc.shape)
        if "diff" in parts:
            acc += parts["strength"] * parts["diff"].double()
    return acc


# ----------------------------------------------------------------- formats


def _scales(model, adapters) -> dict[str, float]:
    targets, _ = plan_targets(model, adapters)
    return {t.name: t.deltas[0].scale for t in targets}


def test_peft_reads_rank_and_alpha_from_adapter_config(tmp_path):
    model = mapped_model(tmp_path)
    changes = {
        "blocks.0.attn.to_q": lora_change(64, 64, 8, 1),
        "blocks.0.attn.to_k": lora_change(64, 64, 8, 2),
        "blocks.1.attn.to_v": lora_change(64, 64, 4, 3),
    }
    folder = write_adapter(tmp_path / "peft", "peft", changes,
                           config={"r": 8, "lora_alpha": 16, "alpha_pattern": {"to_k": 4}, "rank_pattern": {"to_v": 4}})
    assert read_adapter(folder).format == "peft"
    scales = _scales(model, [Adapter(folder, strength=0.5)])
    assert scales == {
        "blocks.0.attn.to_q.weight": pytest.approx(0.5 * 16 / 8),
        "blocks.0.attn.to_k.weight": pytest.approx(0.5 * 4 / 8),
        "blocks.1.attn.to_v.weight": pytest.approx(0.5 * 16 / 4),
    }


def test_peft_rslora_and_alpha_override(tmp_path):
    model = mapped_model(tmp_path)
    changes = {"blocks.0.attn.to_q": lora_change(64, 64, 16, 1)}
    folder = write_adapter(tmp_path / "peft", "peft", changes, config={"r": 16, "lora_alpha": 8, "use_rslora": True})
    assert _scales(model, [folder]) == {"blocks.0.attn.to_q.weight": pytest.approx(8 / 4)}
    overridden = _scales(model, [Adapter(folder, alpha=32.0, rslora=False)])
    assert overridden == {"blocks.0.attn.to_q.weight": pytest.approx(2.0)}


def test_peft_rank_that_contradicts_the_config_is_an_error(tmp_path):
    model = mapped_model(tmp_path)
    changes = {"blocks.0.attn.to_q": lora_change(64, 64, 4, 1)}
    folder = write_adapter(tmp_path / "peft", "peft", changes, config={"r": 8})
    with pytest.raises(AdapterError, match=r"lora_A.weight' has rank 4 but adapter_config.json says r=8"):
        plan_targets(model, [folder])


def test_kohya_underscores_resolve_against_real_module_names(tmp_path):
    model = mapped_model(tmp_path)
    changes = {
        "blocks.0.attn.to_q": lora_change(64, 64, 4, 1, alpha=2),
        "blocks.1.ff.proj_in": lora_change(128, 64, 4, 2, alpha=8),
        "proj_out": lora_change(4, 64, 2, 3),
        "patch_embed": lora_change(64, 4, 2, 4, alpha=1, conv=(2, 2)),
    }
    path = write_adapter(tmp_path / "kohya.safetensors", "kohya", changes)
    assert read_adapter(path).format == "kohya"
    assert _scales(model, [(path, 1.0)]) == {
        "patch_embed.weight": pytest.approx(0.5),
        "blocks.0.attn.to_q.weight": pytest.approx(0.5),
        "blocks.1.ff.proj_in.weight": pytest.approx(2.0),
        "proj_out.weight": pytest.approx(1.0),  # no alpha: alpha = rank
    }


def test_kohya_name_that_two_modules_could_mean_is_an_error(tmp_path):
    root = nn.Module()
    root.a = nn.Module()
    root.a.b_c = nn.Linear(8, 8)
    root.a_b = nn.Module()
    root.a_b.c = nn.Linear(8, 8)
    model = mapped_model(tmp_path, module=root)
    path = write_adapter(tmp_path / "k.safetensors", "kohya", {"a.b_c": lora_change(8, 8, 2, 1)})
    expected = r"k.safetensors: adapter key 'lora_unet_a_b_c.lora_down.weight' could name any of \['a.b_c', 'a_b.c'\]"
    with pytest.raises(KeyResolutionError, match=expected):
        plan_targets(model, [path])


def test_comfyui_diffs_land_on_weight_and_bias(tmp_path):
    model = mapped_model(tmp_path)
    changes = {
        "blocks.0.attn.to_q": {**lora_change(64, 64, 4, 1, alpha=4), "diff_b": torch.randn(64)},
        "blocks.1.norm": {"diff": torch.randn(64), "diff_b": torch.randn(64)},
    }
    path = write_adapter(tmp_path / "comfy.safetensors", "comfyui", changes)
    assert read_adapter(path).format == "comfyui"
    targets, _ = plan_targets(model, [(path, 0.7)])
    by_name = {t.name: t.deltas[0] for t in targets}
    assert list(by_name) == [
        "blocks.0.attn.to_q.weight", "blocks.0.attn.to_q.bias", "blocks.1.norm.weight", "blocks.1.norm.bias",
    ]
    assert by_name["blocks.0.attn.to_q.bias"].up is None and by_name["blocks.0.attn.to_q.bias"].diff_scale == 0.7
    assert by_name["blocks.1.norm.weight"].up is None and by_name["blocks.1.norm.weight"].diff is not None


def test_components_dict_resolves_inside_the_component(tmp_path):
    dit = mapped_model(tmp_path)
    text_encoder = nn.Linear(8, 8)
    path = write_adapter(tmp_path / "c.safetensors", "comfyui", {"blocks.0.attn.to_q": lora_change(64, 64, 4, 1)})
    targets, _ = plan_targets({"dit": dit, "text_encoder": text_encoder}, [path])
    # every target in one component: named as that component names it, so a merge into the
    # dict, into the component alone, or into its checkpoint stores the same layers
    assert [t.name for t in targets] == ["blocks.0.attn.to_q.weight"]
    assert targets[0].module is dit.blocks[0].attn.to_q


def _clip_like(flattened: bool) -> nn.Module:
    """A text encoder named as CLIP's: ``encoder.layers.N.self_attn.q_proj``, under
    ``text_model.`` unless ``flattened`` (transformers 5 dropped that level)."""
    encoder = nn.Module()
    encoder.layers = nn.ModuleList(nn.Module() for _ in range(2))
    for layer in encoder.layers:
        layer.self_attn = nn.Module()
        layer.self_attn.q_proj = nn.Linear(16, 16)
    root = nn.Module()
    if flattened:
        root.encoder = encoder
    else:
        root.text_model = nn.Module()
        root.text_model.encoder = encoder
    return root


@pytest.mark.parametrize("flattened", [True, False])
def test_text_encoder_keys_resolve_with_or_without_clips_text_model_level(tmp_path, flattened):
    """A LoRA written against one CLIP layout lands on the other: kohya's ``lora_te_text_model_...``
    and peft's ``text_encoder.text_model....`` on a flattened model, and keys without the level
    on a model that has it, in a pipeline's dict of components and on the model alone."""
    encoder = mapped_model(tmp_path, module=_clip_like(flattened))
    level = "text_model." if flattened else ""  # the other layout's spelling
    q_proj = f"{'' if flattened else 'text_model.'}encoder.layers.1.self_attn.q_proj.weight"
    kohya = write_adapter(tmp_path / "k.safetensors", "kohya", {f"{level}encoder.layers.1.self_attn.q_proj":
                                                                   lora_change(16, 16, 2, 1, alpha=1)}, prefix="lora_te_")
    peft = write_adapter(tmp_path / "p.safetensors", "comfyui", {f"{level}encoder.layers.1.self_attn.q_proj":
                                                                    lora_change(16, 16, 2, 1)}, prefix="text_encoder.")
    assert _scales(encoder, [kohya]) == {q_proj: pytest.approx(0.5)}
    targets, _ = plan_targets({"text_encoder": encoder, "unet": nn.Linear(4, 4)}, [peft])
    assert [t.name for t in targets] == [q_proj]  # named within its one component
    assert targets[0].module is encoder.get_submodule(q_proj.removesuffix(".weight"))
    unet_key = write_adapter(tmp_path / "u.safetensors", "kohya", {f"{level}encoder.layers.1.self_attn.q_proj":
                                                                    lora_change(16, 16, 2, 1)}, prefix="lora_unet_")
    with pytest.raises(KeyResolutionError, match="match no module"):  # a UNet's key never lands in a text encoder
        plan_targets(encoder, [unet_key])


def test_one_adapter_may_be_given_alone_not_in_a_list(tmp_path):
    """``merge(model, "style.safetensors")``: one adapter, as load_lora takes it; before, the
    string was read a character at a time, each a missing adapter file."""
    model = mapped_model(tmp_path)
    path = write_adapter(tmp_path / "k.safetensors", "kohya", {"proj_out": lora_change(4, 64, 2, 3)})
    for alone in (path, (path, 0.5), Adapter(path, 0.5), {"path": path, "strength": 0.5}):
        (target,), _ = plan_targets(model, alone)
        assert target.name == "proj_out.weight"
    import numpy as np

    (target,), _ = plan_targets(model, (tmp_path / "k.safetensors", np.float32(0.5)))  # a Path, a numpy strength
    assert target.deltas[0].scale == pytest.approx(0.5)
    other = write_adapter(tmp_path / "o.safetensors", "kohya", {"blocks.0.attn.to_q": lora_change(64, 64, 2, 4)})
    assert len(plan_targets(model, (path, other))[0]) == 2  # a tuple of two paths: two adapters
    missing = os.fspath(tmp_path / "missing.safetensors")
    with pytest.raises(AdapterError, match=re.escape(missing)):
        plan_targets(model, missing)
    with pytest.raises(AdapterError, match=r"adapters 7: give a path, .* or a list of them"):
        plan_targets(model, 7)


# ----------------------------------------------------------------- rules and errors


def test_config_regex_rule_maps_a_foreign_layout(tmp_path):
    model = mapped_model(tmp_path)
    changes = {"double_blocks.1.img_attn.q": lora_change(64, 64, 4, 1)}
    path = write_adapter(tmp_path / "x.safetensors", "comfyui", changes, prefix="")
    with pytest.raises(KeyResolutionError):
        plan_targets(model, [path])
    rule = {"match": r"^double_blocks\.(\d+)\.img_attn\.q$", "replace": r"blocks.\1.attn.to_q"}
    targets, _ = plan_targets(model, [Adapter(path, rules=[rule])])
    assert [t.name for t in targets] == ["blocks.1.attn.to_q.weight"]


def test_unmatched_keys_list_the_first_20_and_a_count_and_say_how_to_fix(tmp_path):
    model = mapped_model(tmp_path)
    changes = {f"single_blocks.{i}.linear": lora_change(64, 64, 2, i) for i in range(25)}
    changes["blocks.0.attn.to_q"] = lora_change(64, 64, 2, 99)
    path = write_adapter(tmp_path / "u.safetensors", "comfyui", changes)
    with pytest.raises(KeyResolutionError) as caught:
        plan_targets(model, [path])
    message = str(caught.value)
    assert f"{path}: 25 adapter key(s) match no module" in message
    listed = [line for line in message.splitlines() if "single_blocks" in line]
    assert len(listed) == 20 and "... and 5 more" in message
    assert "rules" in message and "strict: false" in message and "blocks.0.attn.to_k" in message


def test_strict_false_warns_and_merges_what_matches(tmp_path):
    model = mapped_model(tmp_path)
    changes = {"nowhere.q": lora_change(64, 64, 2, 1), "blocks.0.attn.to_q": lora_change(64, 64, 2, 2)}
    path = write_adapter(tmp_path / "s.safetensors", "comfyui", changes)
    with pytest.warns(UserWarning, match=r"(?s)1 adapter key\(s\) match no module.*diffusion_model.nowhere.q.*skipped"):
        targets, _ = plan_targets(model, [Adapter(path, strict=False)])
    assert [t.name for t in targets] == ["blocks.0.attn.to_q.weight"]


def test_shape_mismatch_names_the_key_and_both_shapes(tmp_path):
    model = mapped_model(tmp_path)
    path = write_adapter(tmp_path / "m.safetensors", "kohya", {"blocks.0.attn.to_q": lora_change(96, 64, 4, 1)})
    with pytest.raises(KeyResolutionError) as caught:
        plan_targets(model, [path])
    assert "'lora_unet_blocks_0_attn_to_q.lora_up.weight'" in str(caught.value)
    assert "(96, 64)" in str(caught.value) and "(64, 64)" in str(caught.value)
    assert "'blocks.0.attn.to_q.weight'" in str(caught.value)


@pytest.mark.parametrize(
    "key, variant",
    [
        ("lora_unet_blocks_0_attn_to_q.on_input", "IA3"),
        ("lycoris_blocks_0_attn_to_q.oft_blocks", "OFT or BOFT"),
        ("lycoris_blocks_0_attn_to_q.a1.weight", "GLoRA"),
    ],
)
def test_unsupported_variants_are_refused_naming_the_key(tmp_path, key, variant):
    path = write_safetensors(tmp_path / "v.safetensors", {key: torch.ones(4, 4)})
    with pytest.raises(UnsupportedAdapterError, match=rf"{key}.*{variant}"):
        read_adapter(path)


def test_peft_config_with_dora_but_no_magnitude_vector_is_refused(tmp_path):
    """DoRA merges (tests/lora_cache/test_dora.py); a DoRA folder missing its magnitudes does not."""
    changes = {"blocks.0.attn.to_q": lora_change(64, 64, 8, 1)}
    folder = write_adapter(tmp_path / "peft", "peft", changes, config={"use_dora": True})
    with pytest.raises(KeyResolutionError, match="has no lora_magnitude_vector beside it, but its adapter_config"):
        plan_targets(mapped_model(tmp_path), [folder])


def test_broken_adapters_say_what_is_wrong(tmp_path):
    lonely = write_safetensors(tmp_path / "a.safetensors", {"diffusion_model.x.lora_up.weight": torch.ones(4, 2)})
    with pytest.raises(AdapterError, match=r"lora_up.weight' has no matching down matrix"):
        read_adapter(lonely)
    odd = write_safetensors(tmp_path / "b.safetensors", {"diffusion_model.x.scale": torch.ones(4)})
    with pytest.raises(AdapterError, match=r"'diffusion_model.x.scale' is not a LoRA part"):
        read_adapter(odd)
    with pytest.raises(AdapterError, match="no such file"):
        read_adapter(tmp_path / "missing.safetensors")


@pytest.mark.parametrize("second", ["lora_A.weight", "lora_A.default.weight"])
def test_one_module_given_twice_under_two_spellings_is_refused_naming_both_keys(tmp_path, second):
    """A file joined from two adapters (lora_down/lora_up and lora_A/lora_B of one module),
    or one holding both peft's and DiffSynth's spelling: neither pair may be dropped unsaid."""
    first = lora_change(64, 64, 4, 1)
    other = lora_change(64, 64, 2, 2)
    stem = "diffusion_model.blocks.0.attn.to_q"
    path = write_safetensors(tmp_path / "joined.safetensors", {
        f"{stem}.lora_down.weight": first["down"], f"{stem}.lora_up.weight": first["up"],
        f"{stem}.{second}": other["down"], f"{stem}.{second.replace('lora_A', 'lora_B')}": other["up"],
    })
    with pytest.raises(AdapterError, match="are both the 'down' part of module") as refused:
        read_adapter(path)
    assert f"'{stem}.lora_down.weight'" in str(refused.value) and f"'{stem}.{second}'" in str(refused.value)
    with pytest.raises(AdapterError, match="both the 'down' part of module"):
        plan_targets(mapped_model(tmp_path), [path])
