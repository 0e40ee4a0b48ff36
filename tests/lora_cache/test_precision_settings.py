"""Process settings that change what the merge's kernels compute (fp32 matmuls narrowed to
TF32 or bf16 inside) or how fast they run (instruction caps): the cache key names the
first, so a start is never served bytes its settings would not produce; the kernel
wisdom keys its timings by the second. Each start runs in a process of its own, as a
server sets these once for its whole life."""

from __future__ import annotations

import json
import os

import torch

from lora_cache.kernels.precision import INSTRUCTION_CAPS
from tests.conftest import run_python, write_safetensors
from tests.fresh_fork import TORCH
from tests.lora_cache.test_adapters import lora_change, write_adapter

_START = r"""
import json, sys, warnings, torch
import lora_cache
from lora_cache.placement.layers import checkpoint_module
base, adapter, root, setting = sys.argv[1:5]
if setting != "default":
    torch.backends.mkldnn.matmul.fp32_precision = setting
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    stats = lora_cache.merge(checkpoint_module([base]), [adapter], cache_root=root, device="cpu", progress=False)
print(json.dumps({"key": stats.cache_key, "built": stats.built, "hit": stats.hit,
                  "said": [str(w.message) for w in said]}))
"""


def _start(base: str, adapter: str, root, setting: str) -> dict:
    done = run_python(_START, base, adapter, os.fspath(root), setting, forked_from=TORCH)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_start_that_narrows_fp32_matmuls_is_never_served_an_ieee_build_nor_serves_one(tmp_path):
    gen = torch.Generator().manual_seed(2)
    base = write_safetensors(tmp_path / "base.safetensors",
                             {f"blocks.{i}.proj.weight": torch.randn(96, 64, generator=gen) for i in range(2)})
    adapter = write_adapter(tmp_path / "fp32.safetensors", "comfyui",
                            {f"blocks.{i}.proj": lora_change(96, 64, 8, i, alpha=4) for i in range(2)})
    ieee = _start(base, adapter, tmp_path / "cache", "default")
    assert ieee["built"] == 2 and not ieee["said"]
    narrowed = _start(base, adapter, tmp_path / "cache", "bf16")
    assert narrowed["built"] == 2 and narrowed["key"] != ieee["key"]  # its own combination, built apart
    assert any("fp32 matmuls as bf16" in said and "set it after lora_cache.merge" in said
               for said in narrowed["said"]), narrowed["said"]
    manifest = tmp_path / "cache" / "lora_merge_cache" / narrowed["key"] / "manifest.json"
    assert "+fp32-matmul=bf16" in json.loads(manifest.read_text())["inputs"]["merge_policy"]
    again = _start(base, adapter, tmp_path / "cache", "default")
    assert again["hit"] == 2 and again["key"] == ieee["key"]  # the IEEE build, untouched by the narrowed one


_ENTRY_KEY = "from lora_cache.kernels.wisdom import entry_key; print(entry_key('bfloat16', 'bf16-lora/c', 2))"


def test_instruction_caps_keep_the_kernel_wisdom_apart_and_leave_the_plain_key_as_it_was():
    plain_env = {k: v for k, v in os.environ.items() if k not in INSTRUCTION_CAPS}
    plain = run_python(_ENTRY_KEY, env=plain_env)
    capped = run_python(_ENTRY_KEY, env={**plain_env, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert plain.returncode == capped.returncode == 0, plain.stderr + capped.stderr
    plain_key, capped_key = (json.loads(done.stdout.strip()) for done in (plain, capped))
    assert len(plain_key) == 6  # CPU, flags, torch, dtype, class, threads: the wisdom recorded so far still holds
    assert capped_key[:6] == plain_key and capped_key[6] == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
