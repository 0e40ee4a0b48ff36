"""A start whose every merged layer is cached touches no adapter values, also on a diffusers
model, where the adapters go through diffusers' own converter (which copies and rescales
every tensor): the conversion is recorded by the file's content and the next start plans
from the record. Measured in real starts (fresh interpreters) with hostmem.track_peak_anon,
on a Flux transformer from a small config, with a diffusers-format and a kohya adapter."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

pytest.importorskip("diffusers", reason="the diffusers comparisons need diffusers (pip install hostmem[test])")
pytest.importorskip("peft", reason="the diffusers comparisons need peft (pip install hostmem[test])")

import lora_cache  # noqa: E402
from hostmem.safetensors.mapping import save_file  # noqa: E402
from lora_cache.adapters import read_adapters  # noqa: E402
from lora_cache.adapters.conversion_memo import FOLDER  # noqa: E402
from tests.clients import tiny_models as tm  # noqa: E402
from tests.conftest import run_python  # noqa: E402
from tests.fresh_fork import CLIENTS  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Wide enough, and of a rank high enough, that the adapters (12 MiB) stand well above what a
# hit's own objects and last lazy imports take (1-2 MiB here, whatever the adapter).
WIDE = dict(tm.FLUX, attention_head_dim=64, num_attention_heads=4, axes_dims_rope=[16, 24, 24])
DIM = WIDE["attention_head_dim"] * WIDE["num_attention_heads"]
RANK = 256
KOHYA = {"img_attn_qkv": 3 * DIM, "img_attn_proj": DIM, "txt_attn_qkv": 3 * DIM, "img_mlp_2": DIM}

START = """
import hashlib, json, sys
import diffusers.loaders.lora_pipeline, lora_cache.orchestrate, torch  # imported by a server's start anyway
from hostmem import track_peak_anon
from tests.clients import tiny_models as tm

model_folder, cache, adapters = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
model = tm.load_model("flux", model_folder)
with track_peak_anon() as peak:
    stats = lora_cache.load_lora(model, [tuple(a) for a in adapters], cache_root=cache, progress=False)
digest = hashlib.sha256()
for name, weight in sorted(tm.weights(model).items()):
    digest.update(name.encode() + weight.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
print(json.dumps({"growth": peak.growth_bytes, "hit": stats.hit, "built": stats.built, "layers": stats.layers,
                  "weights": digest.hexdigest()}))
"""


def _diffusers_adapter(model_folder, out) -> str:
    """A rank-256 LoRA made by peft, written by diffusers' save_lora_weights (with metadata)."""
    from peft import LoraConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict

    config = LoraConfig(r=RANK, lora_alpha=RANK // 2, target_modules=tm.TARGETS["flux"], init_lora_weights=False)
    torch.manual_seed(1)
    peft_model = get_peft_model(tm.load_model("flux", model_folder), config)
    layers = {k.removeprefix("base_model.model."): v for k, v in get_peft_model_state_dict(peft_model).items()}
    tm.classes("flux")[1].save_lora_weights(out, transformer_lora_layers=layers,
                                            transformer_lora_adapter_metadata=config.to_dict())
    return os.path.join(out, "pytorch_lora_weights.safetensors")


def _kohya_adapter(path) -> str:
    """kohya sd-scripts BFL names on the double block (fused qkv included), with ``.alpha``."""
    gen = torch.Generator().manual_seed(2)
    tensors = {}
    for name, rows in KOHYA.items():
        cols = 4 * DIM if name == "img_mlp_2" else DIM
        tensors[f"lora_unet_double_blocks_0_{name}.lora_down.weight"] = torch.randn(RANK, cols, generator=gen) / 8
        tensors[f"lora_unet_double_blocks_0_{name}.lora_up.weight"] = torch.randn(rows, RANK, generator=gen) / 8
        tensors[f"lora_unet_double_blocks_0_{name}.alpha"] = torch.tensor(32.0)
    save_file(tensors, path)
    return os.fspath(path)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    root = tmp_path_factory.mktemp("wide")
    torch.manual_seed(0)
    tm.classes("flux")[0](**WIDE).save_pretrained(root / "model")
    model = os.fspath(root / "model")
    return model, _diffusers_adapter(model, root / "diffusers"), _kohya_adapter(root / "kohya.safetensors")


def _start(model, cache, adapters) -> dict:
    done = run_python(START, model, os.fspath(cache), json.dumps(adapters), cwd=REPO, timeout=300, forked_from=CLIENTS)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_start_on_a_diffusers_model_reads_no_adapter_values(wide, tmp_path):
    model, diffusers_file, kohya_file = wide
    adapters = [[diffusers_file, 1.0], [kohya_file, 0.5]]
    adapter_bytes = os.path.getsize(diffusers_file) + os.path.getsize(kohya_file)
    first = _start(model, tmp_path / "cache", adapters)
    second = _start(model, tmp_path / "cache", adapters)
    assert first["built"] == first["layers"] > 0 and second["hit"] == second["layers"] == first["layers"]
    assert second["weights"] == first["weights"]  # bit for bit
    # The first start converts, copying every adapter tensor; the second reads the records only.
    assert first["growth"] >= adapter_bytes, (first["growth"], adapter_bytes)
    assert second["growth"] < adapter_bytes / 4, (second["growth"], adapter_bytes)
    # Without the records, the same hit converts again: the growth they spare.
    shutil.rmtree(tmp_path / "cache" / "lora_merge_cache" / FOLDER)
    unrecorded = _start(model, tmp_path / "cache", adapters)
    assert unrecorded["hit"] == unrecorded["layers"] and unrecorded["weights"] == first["weights"]
    assert unrecorded["growth"] >= adapter_bytes, (unrecorded["growth"], adapter_bytes)


def test_the_record_plans_without_values_and_a_miss_converts_again(wide, tmp_path):
    """After a first merge, the adapter is planned on the meta device; another strength is a
    miss, which converts for real and merges as diffusers' load + fuse does."""
    model_folder, diffusers_file, kohya_file = wide
    cache = tmp_path / "cache"
    lora_cache.load_lora(tm.load_model("flux", model_folder), kohya_file, cache_root=cache, progress=False)
    files = read_adapters(tm.load_model("flux", model_folder), [lora_cache.Adapter(kohya_file)],
                          memo_roots=[os.fspath(cache)])
    parts = [t for change in files[0].modules.values() for role, t in change.parts.items() if role != "alpha"]
    assert parts and all(t.device.type == "meta" for t in parts)
    model = tm.load_model("flux", model_folder)
    stats = lora_cache.load_lora(model, kohya_file, strength=0.5, cache_root=cache, progress=False)
    assert stats.built == stats.layers > 0
    reference = tm.weights(tm.diffusers_fused("flux", model_folder, [(kohya_file, 0.5)]))
    for name, ref in reference.items():
        torch.testing.assert_close(tm.weights(model)[name], ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()))


def test_a_damaged_record_is_no_record(wide, tmp_path):
    """A record that cannot be read means converting again: the same key, a hit, the same bits."""
    model_folder, diffusers_file, _ = wide
    cache = tmp_path / "cache"
    first = tm.load_model("flux", model_folder)
    lora_cache.load_lora(first, diffusers_file, cache_root=cache, progress=False)
    folder = cache / "lora_merge_cache" / FOLDER
    (record,) = (p for p in folder.iterdir() if not p.name.startswith("meaning-"))  # the conversion's record
    record.write_text(record.read_text()[:100])
    files = read_adapters(tm.load_model("flux", model_folder), [lora_cache.Adapter(diffusers_file)],
                          memo_roots=[os.fspath(cache)])
    assert all(t.device.type == "cpu" for change in files[0].modules.values() for t in change.parts.values())
    second = tm.load_model("flux", model_folder)
    stats = lora_cache.load_lora(second, diffusers_file, cache_root=cache, progress=False)
    assert stats.hit == stats.layers > 0
    ours, theirs = tm.weights(second), tm.weights(first)
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
    rewritten = json.loads(record.read_text())
    assert rewritten["kind"] == "diffusers"  # written again whole
    # naming the digest the combination names for the file: hostmem cache prune keeps it
    from hostmem.vault.records import input_digests

    (manifest,) = (cache / "lora_merge_cache").glob("*/manifest.json")
    assert rewritten["digest"] in input_digests(json.loads(manifest.read_text())["inputs"])


def test_a_layer_lost_from_the_cache_is_rebuilt_from_a_conversion_made_then(wide, tmp_path):
    """Planned from the record, a start that finds one layer missing converts then (after
    looking the others up, before installing anything) and rebuilds that layer alone."""
    model_folder, diffusers_file, _ = wide
    cache = tmp_path / "cache"
    first = tm.load_model("flux", model_folder)
    stats = lora_cache.load_lora(first, diffusers_file, cache_root=cache, progress=False)
    layers = sorted((cache / "lora_merge_cache" / stats.cache_key).glob("*.safetensors"))
    layers[0].unlink()
    second = tm.load_model("flux", model_folder)
    again = lora_cache.load_lora(second, diffusers_file, cache_root=cache, progress=False)
    assert (again.hit, again.built) == (stats.layers - 1, 1) and again.cache_key == stats.cache_key
    ours, theirs = tm.weights(second), tm.weights(first)
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
