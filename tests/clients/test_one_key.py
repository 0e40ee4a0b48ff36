"""One key per meaning: ``hostmem lora merge CONFIG`` (this package's reader, on the
checkpoint), ``lora_cache.load_lora(pipe)`` (diffusers' converter, the layers named within a
pipeline's component) and ``lora_cache.set_adapters`` on the same base, adapter and
strength share one combination: an image built ahead of time serves a diffusers server."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("diffusers", reason="the diffusers comparisons need diffusers (pip install hostmem[test])")
pytest.importorskip("peft", reason="the diffusers comparisons need peft (pip install hostmem[test])")

from tests.clients import tiny_models as tm  # noqa: E402
from tests.conftest import run_python, write_lora_config  # noqa: E402
from tests.fresh_fork import CLI, CLIENTS  # noqa: E402

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
    return write_lora_config(tmp_path, model, adapter, strength=0.8, layers="transformer_blocks.{i}.", name="one-key")


def _files(root) -> dict[str, int]:
    return {os.path.join(d, f): os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(root) for f in names}


@pytest.mark.parametrize("layout", ["diffusers_meta", "peft"])
def test_an_image_built_by_the_cli_serves_a_diffusers_pipeline(tmp_path, layout):
    model = tm.save_model("flux", tmp_path / "model", torch.bfloat16)
    written = tm.write_adapters("flux", model, tmp_path / "adapters")[layout]
    adapter = written if layout == "peft" else os.path.join(written, "pytorch_lora_weights.safetensors")
    cli = run_python(CLI, "lora", "merge", _config(tmp_path, model, adapter), "--json", timeout=300,
                     forked_from=CLIENTS)
    assert cli.returncode == 0, cli.stderr
    built = json.loads(cli.stdout)
    assert built["built"] == built["layers"] > 0
    before = _files(tmp_path / "cache")
    start = run_python(START, model, adapter, str(tmp_path / "cache"), timeout=300, forked_from=CLIENTS)
    assert start.returncode == 0, start.stderr
    served = json.loads(start.stdout.splitlines()[-1])
    assert served["cache_key"] == built["cache_key"]
    assert (served["hit"], served["built"], served["bytes_written"]) == (built["layers"], 0, 0)
    assert (served["switch"], served["switch_layers"], served["same"]) == ("cached", built["layers"], True)
    after = _files(tmp_path / "cache")
    changed = {p for p in after if before.get(p) != after[p]} | (before.keys() - after.keys())
    # nothing of the combination is written; only the record of diffusers' conversion is new
    assert all(os.sep + "conversions" + os.sep in p for p in changed), changed


SERVE = """
import json, sys
import torch
import planners
from tests.clients import tiny_models as tm

model = tm.load_model("flux", sys.argv[1], torch.bfloat16)
print(json.dumps(planners.start(sys.argv[2], {"dit": model}, quiet=True, pin=False).merge_stats.to_dict()))
"""


def test_an_image_baked_read_only_serves_a_server_that_lists_its_own_root_after_it(tmp_path, read_only_copy):
    """The image's records name what its combination was keyed by (the adapter's meaning,
    read through diffusers' converter): a server whose values the converter's record spares
    from loading finds them there, not only in its own writable root."""
    model = tm.save_model("flux", tmp_path / "model", torch.bfloat16)
    adapter = os.path.join(tm.write_adapters("flux", model, tmp_path / "adapters")["diffusers_meta"],
                           "pytorch_lora_weights.safetensors")
    config = _config(tmp_path, model, adapter)
    cli = run_python(CLI, "lora", "merge", config, "--json", timeout=300, forked_from=CLIENTS)
    assert cli.returncode == 0, cli.stderr
    built = json.loads(cli.stdout)
    image = read_only_copy(str(tmp_path / "cache"))
    served_config = tmp_path / "server.yaml"
    served_config.write_text(open(config).read().replace(f"root: {tmp_path / 'cache'}",
                                                         f"roots: [{image}, {tmp_path / 'own'}]"))
    start = run_python(SERVE, model, str(served_config), timeout=300, forked_from=CLIENTS)
    assert start.returncode == 0, start.stderr
    served = json.loads(start.stdout.splitlines()[-1])
    assert (served["cache_key"], served["hit"], served["built"]) == (built["cache_key"], built["layers"], 0), served
    assert served["cache_root"] == image


def test_one_math_in_two_layouts_is_one_key(tmp_path):
    """A peft folder and a musubi-tuner file holding the same factors at the same scale (alpha =
    rank) mean one merge: the second start finds every layer the first built; a file whose
    values differ in one factor is another key."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    import lora_cache
    from hostmem.safetensors.mapping import save_file

    model = tm.save_model("wan", tmp_path / "model")
    torch.manual_seed(2)
    lora = LoraConfig(r=4, lora_alpha=4, target_modules=["attn1.to_q", "attn2.to_out.0"], init_lora_weights=False)
    get_peft_model(tm.load_model("wan", model), lora).save_pretrained(tmp_path / "peft")
    peft = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    names = {"attn1.to_q": "self_attn_q", "attn2.to_out.0": "cross_attn_o"}
    musubi = {}
    for key, value in peft.items():
        module, factor = key.removeprefix("base_model.model.").rsplit(".lora_", 1)
        block, _, name = module.removeprefix("blocks.").partition(".")
        musubi[f"lora_unet_blocks_{block}_{names[name]}.{'lora_down' if factor.startswith('A') else 'lora_up'}"
               ".weight"] = value
    save_file(musubi, tmp_path / "musubi.safetensors")
    changed = dict(musubi, **{k: v * 2 for k, v in musubi.items() if k.endswith("self_attn_q.lora_up.weight")})
    save_file(changed, tmp_path / "other.safetensors")
    cache = tmp_path / "cache"
    first = lora_cache.load_lora(tm.load_model("wan", model), os.fspath(tmp_path / "peft"), 0.8, cache, progress=False)
    same = lora_cache.load_lora(tm.load_model("wan", model), os.fspath(tmp_path / "musubi.safetensors"), 0.8, cache,
                                progress=False)
    other = lora_cache.load_lora(tm.load_model("wan", model), os.fspath(tmp_path / "other.safetensors"), 0.8, cache,
                                 progress=False)
    assert first.built == first.layers == 4
    assert (same.cache_key, same.hit, same.built) == (first.cache_key, 4, 0)
    assert other.cache_key != first.cache_key and other.built == 4
