"""``hostmem lora merge`` builds for the weights the server holds: the dtype it casts to at load
(``components.<name>.dtype``: an fp32 checkpoint loaded with ``torch_dtype=torch.bfloat16``)
and the variant it loads from a folder holding several (``variant: fp16``, as diffusers'
``from_pretrained(variant="fp16")``). A checkpoint holding a tensor twice is refused, as
``hostmem plan`` refuses it, instead of built from whichever file came last."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

pytest.importorskip("diffusers", reason="the server's model needs diffusers (pip install hostmem[test])")
pytest.importorskip("peft", reason="diffusers' LoRA loading needs peft (pip install hostmem[test])")

import planners  # noqa: E402
from planners.cli import main as cli  # noqa: E402
from tests.clients import tiny_models as tm  # noqa: E402


def _config(tmp_path, model: str, adapter: str, cache: str = "cache", **dit) -> str:
    path = tmp_path / "deploy.yaml"
    path.write_text(json.dumps({  # JSON is YAML
        "deployment": "served-weights", "host": {"limit": "8GiB", "reserve": "1GiB"}, "workload": {"steps": 4},
        "components": {"dit": {"path": model, "offload": "layerwise", "layers": "transformer_blocks.{i}.", **dit}},
        "lora": {"adapters": [{"path": adapter, "strength": 0.8}],
                 "cache": {"root": os.fspath(tmp_path / cache), "enabled": True}}}))
    return os.fspath(path)


def _adapter(model: str, tmp_path) -> str:
    written = tm.write_adapters("flux", model, tmp_path / "adapters")["diffusers_meta"]
    return os.path.join(written, "pytorch_lora_weights.safetensors")


def _build(config: str, capsys) -> dict:
    capsys.readouterr()
    assert cli(["lora", "merge", config, "--json", "--no-progress"]) == 0, capsys.readouterr().err
    built = json.loads(capsys.readouterr().out)
    assert built["built"] == built["layers"] > 0
    return built


def _served(config: str, model) -> dict:
    return planners.start(config, {"dit": model}, quiet=True, pin=False).merge_stats.to_dict()


def test_a_build_for_the_served_dtype_is_what_a_casting_server_finds(tmp_path, capsys):
    model = tm.save_model("flux", tmp_path / "model", torch.float32)
    config = _config(tmp_path, model, _adapter(model, tmp_path), dtype="bf16")
    built = _build(config, capsys)
    assert built["built_for"].startswith("built for bf16 weights")
    served = _served(config, tm.load_model("flux", model, torch.bfloat16))
    assert (served["cache_key"], served["hit"], served["built"]) == (built["cache_key"], built["layers"], 0)


def test_a_target_the_model_class_keeps_in_fp32_is_built_in_fp32_as_the_loader_holds_it(tmp_path, capsys,
                                                                                         monkeypatch):
    """Wan keeps its time embedder in fp32 under any torch_dtype (``_keep_in_fp32_modules``): a
    LoRA on it (lightx2v's time_embedding.0) is built for the fp32 weight the server holds."""
    monkeypatch.setitem(tm.TARGETS, "wan", ["to_q", "time_embedder.linear_1"])
    model = tm.save_model("wan", tmp_path / "model", torch.bfloat16)
    written = tm.write_adapters("wan", model, tmp_path / "adapters")["diffusers_meta"]
    config = _config(tmp_path, model, os.path.join(written, "pytorch_lora_weights.safetensors"), dtype="bf16")
    config_text = open(config).read().replace('"transformer_blocks.{i}."', '"blocks.{i}."')
    with open(config, "w") as handle:
        handle.write(config_text)
    built = _build(config, capsys)
    assert built["built_for"].endswith("1 kept in fp32 as the model class keeps them"), built["built_for"]
    loaded = tm.load_model("wan", model, torch.bfloat16)
    assert loaded.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32
    served = _served(config, loaded)
    assert (served["cache_key"], served["hit"], served["built"]) == (built["cache_key"], built["layers"], 0)


def test_a_build_at_the_checkpoints_dtype_says_which_setting_a_casting_server_needs(tmp_path, capsys):
    model = tm.save_model("flux", tmp_path / "model", torch.bfloat16)
    config = _config(tmp_path, model, _adapter(model, tmp_path))
    capsys.readouterr()
    assert cli(["lora", "merge", config, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "built for the checkpoint's bf16 weights" in out and "components.dit.dtype" in out
    quantized = _config(tmp_path, model, _adapter(model, tmp_path), dtype="int8")
    assert cli(["lora", "merge", quantized, "--no-progress"]) == 2  # a quantization at load: nothing to build for
    assert "components.dit.dtype is int8, a quantization" in capsys.readouterr().err


def test_a_variant_named_in_the_config_is_built_and_served_and_plain_weights_are_the_default(tmp_path, capsys):
    model = tm.save_model("flux", tmp_path / "model", torch.float32)
    tm.classes("flux")[0].from_pretrained(model).to(torch.float16).save_pretrained(model, variant="fp16")
    assert sorted(n for n in os.listdir(model) if n.endswith(".safetensors")) == [
        "diffusion_pytorch_model.fp16.safetensors", "diffusion_pytorch_model.safetensors"]
    adapter = _adapter(model, tmp_path)
    variant = _config(tmp_path, model, adapter, variant="fp16")
    built = _build(variant, capsys)
    loaded = tm.classes("flux")[0].from_pretrained(model, variant="fp16", torch_dtype=torch.float16).eval()
    served = _served(variant, loaded)
    assert (served["cache_key"], served["hit"], served["built"]) == (built["cache_key"], built["layers"], 0)
    plain = _config(tmp_path, model, adapter)
    assert cli(["plan", plain]) == 0, capsys.readouterr().err  # the plain weights, as from_pretrained loads them
    assert _build(plain, capsys)["cache_key"] != built["cache_key"]
    missing = _config(tmp_path, model, adapter, variant="bf16")
    assert cli(["lora", "merge", missing]) == 2
    assert "no weights of variant 'bf16'" in capsys.readouterr().err


def test_a_tensor_held_twice_is_refused_not_built_from_the_last_file(tmp_path, capsys):
    """A folder of other names than diffusers' (every file is the checkpoint) holding a tensor
    twice is refused, as plan refuses it; beside diffusers' weights, another file is not part of
    the checkpoint (from_pretrained never reads it) and the build goes on."""
    model = tm.save_model("flux", tmp_path / "model", torch.bfloat16)
    adapter = _adapter(model, tmp_path)
    weights = os.path.join(model, "diffusion_pytorch_model.safetensors")
    shutil.copy(weights, os.path.join(model, "old-copy.safetensors"))
    _build(_config(tmp_path, model, adapter), capsys)
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in ("part-1.safetensors", "part-2.safetensors"):
        shutil.copy(weights, plain / name)
    root = tmp_path / "other-cache"
    config = _config(tmp_path, os.fspath(plain), adapter, cache="other-cache")
    capsys.readouterr()
    assert cli(["lora", "merge", config, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "is also in" in err and "part-1.safetensors" in err
    assert not os.path.exists(root / "lora_merge_cache") or not os.listdir(root / "lora_merge_cache")
