"""diffusers and peft calls that write into read-only hostmem weights, each in its own process.

A known entry point raises a Python error before it writes anything; any other writer
dies of SIGSEGV as before, but after a report saying which weight was written. Each
case runs in a fresh interpreter, so a guard that fails kills that child, not the run.
"""

from __future__ import annotations

import signal

import pytest

from tests.conftest import run_python
from tests.fresh_fork import CLIENTS

pytest.importorskip("diffusers", reason="the foreign-writer tests run the real diffusers")
pytest.importorskip("peft", reason="the foreign-writer tests run the real peft")

# A tiny Flux transformer saved to argv[1], loaded back as diffusers loads it, in a
# pipeline with only a transformer; ``lora`` is a diffusers-format LoRA on every to_q.
_PRELUDE = """
import os, sys, torch, hostmem, lora_cache
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from hostmem.slots import MappedAreas
from hostmem.safetensors.writers import ReadOnlyWeightsError

folder = sys.argv[1]
torch.manual_seed(0)
FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                       num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                       axes_dims_rope=[4, 4, 8]).save_pretrained(folder)
checkpoint = hostmem.load_readonly(os.path.join(folder, "diffusion_pytorch_model.safetensors"))
transformer = FluxTransformer2DModel.from_pretrained(folder)
pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None, tokenizer=None,
                    text_encoder_2=None, tokenizer_2=None, transformer=transformer)
lora = {}
for name, module in transformer.named_modules():
    if name.endswith("attn.to_q"):
        lora[f"transformer.{name}.lora_A.weight"] = torch.randn(4, module.in_features)
        lora[f"transformer.{name}.lora_B.weight"] = torch.randn(module.out_features, 4)

def untouched():
    merged = [n for n, m in transformer.named_modules() if getattr(m, "merged", False)]
    changed = [n for n, p in transformer.named_parameters()
               if n.replace("base_layer.", "") in checkpoint and not torch.equal(p, checkpoint[n.replace("base_layer.", "")])]
    return not merged and not changed

def expect_error(call):
    try:
        call()
    except ReadOnlyWeightsError as exc:
        print("RAISED", exc)
    else:
        print("NOT RAISED")
"""


def _run(tmp_path, scenario: str):
    done = run_python(_PRELUDE + scenario, str(tmp_path / "flux"), timeout=300, forked_from=CLIENTS)
    return done


def _raised(done) -> str:
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith(("RAISED", "NOT RAISED"))]
    assert lines and lines[0].startswith("RAISED"), done.stdout[-2000:]
    return lines[0]


def test_pipeline_fuse_lora_on_a_remapped_pipeline_raises_before_writing(tmp_path):
    done = _run(tmp_path, """
hostmem.remap(pipe)
pipe.load_lora_weights(lora)          # writes nothing: the adapter runs beside the mapped base
expect_error(lambda: pipe.fuse_lora())
print("untouched", untouched())
pipe.fuse_lora(safe_fusing=True)      # merges into a copy: allowed, and the copy is anonymous
print("fused", all(MappedAreas().read_only_file(m.base_layer.weight) is None
                   for n, m in transformer.named_modules() if n.endswith("attn.to_q")))
""")
    line = _raised(done)
    assert "FluxPipeline.fuse_lora() would write into 2 read-only hostmem weight(s)" in line
    assert "transformer.transformer_blocks.0.attn.to_q.base_layer.weight" in line
    assert "diffusion_pytorch_model.safetensors" in line
    assert "lora_cache.load_lora" in line and "hostmem.make_writable" in line
    assert "untouched True" in done.stdout and "fused True" in done.stdout


def test_model_fuse_lora_on_a_remapped_model_raises(tmp_path):
    done = _run(tmp_path, """
from peft import LoraConfig
hostmem.remap(transformer)
transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_k"], init_lora_weights=False))
expect_error(lambda: transformer.fuse_lora())
print("untouched", untouched())
""")
    line = _raised(done)
    assert "FluxTransformer2DModel.fuse_lora() would write into" in line and "attn.to_k.base_layer.weight" in line
    assert "untouched True" in done.stdout


def test_unfuse_lora_of_read_only_merged_weights_raises(tmp_path):
    done = _run(tmp_path, """
pipe.load_lora_weights(lora)
pipe.fuse_lora()                      # a plain diffusers fuse, into writable weights
fused = {n: m.base_layer.weight.detach().clone() for n, m in transformer.named_modules() if n.endswith("attn.to_q")}
path = os.path.join(folder, "fused.safetensors")
hostmem.save_file(fused, path)
mapped = hostmem.load_readonly(path)
for name, module in transformer.named_modules():
    if name in mapped:                # the fused weights, now read-only views (as a cache would hold them)
        module.base_layer.weight = torch.nn.Parameter(mapped[name], requires_grad=False)
expect_error(lambda: pipe.unfuse_lora())
print("still fused", all(torch.equal(m.base_layer.weight, fused[n]) for n, m in transformer.named_modules() if n in fused))
""")
    line = _raised(done)
    assert "FluxPipeline.unfuse_lora() would write into 2 read-only" in line and "lora_cache.unmerge(model)" in line
    assert "still fused True" in done.stdout


def test_load_lora_weights_on_a_model_merged_by_the_cache_raises(tmp_path):
    done = _run(tmp_path, """
path = os.path.join(folder, "lora.safetensors")
hostmem.save_file(lora, path)
print(lora_cache.merge(transformer, [(path, 1.0)], cache_root=os.path.join(folder, "cache"),
                       base_files=[os.path.join(folder, "diffusion_pytorch_model.safetensors")]))
expect_error(lambda: pipe.load_lora_weights(lora))
print("peft layers", sum(hasattr(m, "base_layer") for m in transformer.modules()))
""")
    line = _raised(done)
    assert "FluxPipeline.load_lora_weights() on a model that holds a LoRA merged by lora_cache" in line
    assert "lora_cache.unmerge(model)" in line and "lora_merge_cache" in line
    assert "peft layers 0" in done.stdout


def test_peft_merge_and_unload_on_mapped_weights_raises(tmp_path):
    done = _run(tmp_path, """
from peft import LoraConfig, get_peft_model
base = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
path = os.path.join(folder, "seq.safetensors")
hostmem.save_file(base.state_dict(), path)
mapped = hostmem.load_readonly(path)
base.load_state_dict(mapped, assign=True)      # the weights are read-only views now
model = get_peft_model(base, LoraConfig(r=2, target_modules=["0", "1"], init_lora_weights=False))
expect_error(lambda: model.merge_and_unload())
expect_error(lambda: model.merge_adapter())
print("untouched", all(torch.equal(base[i].weight, mapped[f"{i}.weight"]) for i in (0, 1))
      and not any(getattr(m, "merged", False) for m in model.modules()))
""")
    line = _raised(done)
    assert "LoraModel.merge_and_unload() would write into 2 read-only hostmem weight(s)" in line
    assert "0.base_layer.weight" in line and "lora_cache.merge" in line
    assert done.stdout.count("RAISED") == 2 and "NOT RAISED" not in done.stdout
    assert "untouched True" in done.stdout


def test_an_unknown_writer_dies_with_a_report(tmp_path):
    done = _run(tmp_path, """
hostmem.remap(pipe)
pipe.load_lora_weights(lora)
layer = transformer.transformer_blocks[0].attn.to_q
print("merging", flush=True)
layer.merge()                         # peft's layer merge, called directly: no entry point sees it
""")
    assert done.returncode == -signal.SIGSEGV
    assert "merging" in done.stdout
    assert "hostmem: fatal SIGSEGV: something wrote into a read-only hostmem weight" in done.stderr
    assert "tensor 'transformer_blocks.0.attn.to_q.weight'" in done.stderr
    assert "hostmem.make_writable(model)" in done.stderr


def test_a_library_imported_after_the_weights_were_mapped_is_guarded_too(tmp_path):
    done = run_python("""
import os, sys, torch, hostmem
path = os.path.join(sys.argv[1], "seq.safetensors")
os.makedirs(sys.argv[1])
hostmem.save_file(torch.nn.Linear(32, 32).state_dict(), path)
mapped = hostmem.load_readonly(path)            # read-only weights handed out before peft is imported
assert "peft" not in sys.modules
from peft import LoraConfig, get_peft_model     # guarded as it is imported
base = torch.nn.Sequential(torch.nn.Linear(32, 32))
base[0].load_state_dict(mapped, assign=True)
model = get_peft_model(base, LoraConfig(r=2, target_modules=["0"], init_lora_weights=False))
try:
    model.merge_and_unload()
except hostmem.ReadOnlyWeightsError as exc:
    print("RAISED", exc)
""", str(tmp_path / "late"), timeout=300)
    line = _raised(done)
    assert "merge_and_unload() would write into 1 read-only hostmem weight(s) (model.0.base_layer.weight;" in line
