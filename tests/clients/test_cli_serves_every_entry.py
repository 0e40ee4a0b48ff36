"""An image built by ``hostmem lora merge CONFIG`` serves every way a server loads the same
adapter: ``load_lora`` on a pipeline and on a model, ``merge`` of the model, and the
switches (``set_adapters`` on the model, ``set_pipeline_adapters`` on the pipeline), for
every layout the server path accepts, key rules included: each finds every layer the
build made and builds none. The CLI reads the adapters as the server's diffusers model
does (the class the checkpoint's ``config.json`` names), so files only diffusers'
converter or the family rules place (musubi Wan, kohya and ai-toolkit Flux) are built
too, under the key the server looks up."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("diffusers", reason="the server's entry points need diffusers (pip install hostmem[test])")
pytest.importorskip("peft", reason="diffusers' LoRA loading needs peft (pip install hostmem[test])")

import lora_cache  # noqa: E402
from hostmem.safetensors.mapping import save_file  # noqa: E402
from lora_cache.switching.diffusers_switch import set_pipeline_adapters  # noqa: E402
from planners.cli import main as cli  # noqa: E402
from tests.clients import tiny_models as tm  # noqa: E402

STRENGTH = 0.8
_MUSUBI_RULE = {"match": r"^lora_unet_blocks_(\d+)_self_attn_q$", "replace": r"blocks.\1.attn1.to_q"}


def _factors(path, stems: dict, names=("lora_down.weight", "lora_up.weight"), alpha: float | None = 2.0) -> str:
    gen, tensors = torch.Generator().manual_seed(5), {}
    for stem, (rows, cols) in stems.items():
        tensors[f"{stem}.{names[0]}"] = torch.randn(4, cols, generator=gen) / cols**0.5
        tensors[f"{stem}.{names[1]}"] = torch.randn(rows, 4, generator=gen)
        if alpha is not None:
            tensors[f"{stem}.alpha"] = torch.tensor(alpha)
    save_file(tensors, path)
    return os.fspath(path)


def _adapter(layout: str, model: str, folder) -> str:
    if layout in ("diffusers_meta", "peft"):
        written = tm.write_adapters(_KIND[layout], model, folder)[layout]
        return written if layout == "peft" else os.path.join(written, "pytorch_lora_weights.safetensors")
    if layout in ("wan-musubi", "wan-musubi-rules"):
        return _factors(folder / "musubi.safetensors", {"lora_unet_blocks_0_self_attn_q": (24, 24),
                                                        "lora_unet_blocks_1_ffn_0": (32, 24)})
    if layout == "wan-lightx2v":
        return _factors(folder / "lightx2v.safetensors", {"diffusion_model.blocks.0.cross_attn.k": (24, 24)})
    if layout == "flux-kohya":
        return _factors(folder / "kohya.safetensors", {"lora_unet_double_blocks_0_img_attn_qkv": (96, 32),
                                                       "lora_unet_single_blocks_0_linear2": (32, 160)})
    return _factors(folder / "bfl.safetensors", {"diffusion_model.double_blocks.0.img_attn.qkv": (96, 32)},
                    ("lora_A.weight", "lora_B.weight"), alpha=None)  # flux-ai-toolkit


_KIND = {"diffusers_meta": "flux", "peft": "flux", "wan-musubi": "wan", "wan-musubi-rules": "wan",
         "wan-lightx2v": "wan", "flux-kohya": "flux", "flux-ai-toolkit": "flux"}


def _config(tmp_path, model: str, adapter: str, rules: list) -> str:
    path = tmp_path / "deploy.yaml"
    entry = {"path": adapter, "strength": STRENGTH, **({"rules": rules} if rules else {})}
    path.write_text(json.dumps({  # JSON is YAML
        "deployment": "cli-serves", "host": {"limit": "8GiB", "reserve": "1GiB"}, "workload": {"steps": 4},
        "components": {"dit": {"path": model, "offload": "layerwise", "layers": "blocks.{i}."}},
        "lora": {"adapters": [entry], "cache": {"root": os.fspath(tmp_path / "cache"), "enabled": True}}}))
    return os.fspath(path)


def _entry_points(kind: str, model: str, adapter: str, rules: list, root: str):
    """Each way a server loads the adapter: ``(name, stats-like: hit, built, layers)``."""
    spec = lora_cache.Adapter(adapter, STRENGTH, rules=rules)
    out = {}
    stats = lora_cache.load_lora(tm.pipeline(kind, tm.load_model(kind, model)), spec, cache_root=root, progress=False)
    out["load_lora(pipe)"] = (stats.hit, stats.built, stats.layers)
    stats = lora_cache.load_lora(tm.load_model(kind, model), spec, cache_root=root, progress=False)
    out["load_lora(model)"] = (stats.hit, stats.built, stats.layers)
    stats = lora_cache.merge(tm.load_model(kind, model), [spec], root, progress=False)
    out["merge(model)"] = (stats.hit, stats.built, stats.layers)
    switch = lora_cache.set_adapters(tm.load_model(kind, model), [spec], root, background=False)
    out["set_adapters(model)"] = (switch.layers if switch.mode == "cached" else 0, 0, switch.layers)
    if not rules:  # set_pipeline_adapters takes what load_lora_weights takes: files, no key rules
        switch = set_pipeline_adapters(tm.pipeline(kind, tm.load_model(kind, model)), ["a"], [STRENGTH],
                                       files={"a": adapter}, cache_root=root, background=False)
        out["set_pipeline_adapters(pipe)"] = (switch.layers if switch.mode == "cached" else 0, 0, switch.layers)
    return out


@pytest.mark.parametrize("layout", sorted(_KIND))
def test_an_image_built_by_the_cli_serves_every_entry_point(tmp_path, capsys, layout):
    kind = _KIND[layout]
    model = tm.save_model(kind, tmp_path / "model")
    os.makedirs(tmp_path / "adapters")
    adapter = _adapter(layout, model, tmp_path / "adapters")
    rules = [_MUSUBI_RULE] if layout.endswith("-rules") else []
    assert cli(["lora", "merge", _config(tmp_path, model, adapter, rules), "--json", "--no-progress"]) == 0
    built = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert built["built"] == built["layers"] > 0
    served = _entry_points(kind, model, adapter, rules, os.fspath(tmp_path / "cache"))
    assert served == dict.fromkeys(served, (built["layers"], 0, built["layers"])), served
