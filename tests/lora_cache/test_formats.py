"""The adapter formats, one module each, tried from one list: every module in the folder is
in the list (or read where the list says), each offers the same interface, and files of
each layout are claimed by the format they are in."""

from __future__ import annotations

import pkgutil

import pytest
import torch

from lora_cache.adapters import formats, read_adapter
from tests.conftest import write_safetensors

_NOT_TRIED = {"base", "kohya_flux"}  # the interface; the fallback diffusers_format reaches


def test_every_format_module_is_in_the_one_list_with_the_same_interface():
    found = {m.name for m in pkgutil.iter_modules(formats.__path__)} - _NOT_TRIED
    assert found == {fmt.__name__.rpartition(".")[2] for fmt in formats.FORMATS}
    for fmt in (*formats.FORMATS, formats.kohya_flux):
        assert isinstance(fmt.NAME, str) and callable(fmt.claims) and callable(fmt.read), fmt.__name__
        assert all(isinstance(s, str) and isinstance(r, str) for s, r in fmt.ROLES), fmt.__name__
    assert formats.FORMATS[0] is formats.refused and formats.FORMATS[-1] is formats.plain
    suffixes = [suffix for suffix, _ in formats.ROLES]
    assert len(suffixes) == len(set(suffixes)), "two formats name one suffix as different parts"


_PAIR = {"lora_down.weight": (4, 8), "lora_up.weight": (8, 4)}


@pytest.mark.parametrize("stem, parts, metadata, name", [
    ("lora_unet_blocks_0_attn_to_q", _PAIR, {}, "kohya"),
    ("diffusion_model.blocks.0.self_attn.q", _PAIR, {}, "comfyui"),
    ("transformer.blocks.0.attn1.to_q", {"lora_A.weight": (4, 8), "lora_B.weight": (8, 4)}, {}, "diffusers"),
    ("blocks.0.attn1.to_q", {"lora_A.weight": (4, 8), "lora_B.weight": (8, 4)}, {}, "peft"),
    ("lycoris_blocks_0_attn1_to_q", {**_PAIR, "dora_scale": (1, 8)}, {}, "lycoris"),
    ("lora_unet_blocks_0_attn_to_q", {"hada_w1_a": (8, 4), "hada_w1_b": (4, 8), "hada_w2_a": (8, 4),
                                      "hada_w2_b": (4, 8), "alpha": ()}, {}, "lycoris-loha"),
    ("lycoris_blocks_0_attn1_to_q", {"lokr_w1": (2, 2), "lokr_w2_a": (4, 2), "lokr_w2_b": (2, 4)}, {}, "lycoris-lokr"),
    ("lora_unet_conv_in", {"lora_down.weight": (4, 8, 1, 1), "lora_mid.weight": (4, 4, 3, 3),
                           "lora_up.weight": (8, 4, 1, 1)}, {}, "lycoris-locon-tucker"),
    ("blocks.0.attn1.to_q", {"diff": (8, 8), "diff_b": (8,)}, {}, "full-diffs"),
    ("blocks.0.proj_lora1", {"down.weight": (4, 8), "up.weight": (8, 4)}, {}, "lora"),
])
def test_a_file_is_read_by_the_first_format_that_claims_it(tmp_path, stem, parts, metadata, name):
    path = write_safetensors(tmp_path / "a.safetensors", {f"{stem}.{p}": torch.ones(s) for p, s in parts.items()})
    assert formats.detect([f"{stem}.{p}" for p in parts], metadata).NAME == name
    adapter = read_adapter(path)
    assert adapter.format == name and set(adapter.modules) == {stem}
    assert set(adapter.modules[stem].keys) <= {role for _, role in formats.ROLES}


def test_a_refused_variant_wins_over_every_prefix_and_names_its_key(tmp_path):
    keys = {"lora_unet_x.lora_down.weight": (4, 8), "lora_unet_x.lora_up.weight": (8, 4),
            "lora_unet_y.hada_w1_a": (2, 2), "lora_unet_y.on_input": ()}
    path = write_safetensors(tmp_path / "a.safetensors", {k: torch.ones(s) for k, s in keys.items()})
    assert formats.detect(keys, {}) is formats.refused
    with pytest.raises(Exception, match=r"'lora_unet_y.on_input' belongs to an adapter of a kind lora_cache does not merge, IA3"):
        read_adapter(path)
