"""A hit imports nothing inside ``merge``: what it needs comes with ``from lora_cache import merge``.

A server imports at its own import and starts its clock after; a hit that imports the
vault, the adapters' readers or the progress bar's multiprocessing lock inside the first
``merge`` call adds that to every start (50-270 ms measured). Asked of a fresh interpreter:
the modules in ``sys.modules`` before and after a hit.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

import lora_cache
from hostmem.safetensors.mapping import load_readonly
from tests.conftest import run_python, write_safetensors
from tests.lora_cache.test_adapters import lora_change, write_adapter

_HIT = r"""
import json, sys
import torch
from torch import nn
from hostmem.safetensors.mapping import load_readonly
from lora_cache import merge

base, adapter, root = sys.argv[1:4]
model = nn.Sequential(*(nn.Linear(256, 128, bias=False) for _ in range(4)))
for name, tensor in load_readonly(base).items():
    owner, _, attr = name.rpartition(".")
    model.get_submodule(owner)._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
before = set(sys.modules)
stats = merge(model, [adapter], cache_root=root, base_files=[base], progress=False, rounding="merge")
print(json.dumps({"hit": stats.hit, "imported": sorted(set(sys.modules) - before)}))
"""


def test_a_hit_imports_nothing_inside_merge(tmp_path):
    gen = torch.Generator().manual_seed(5)
    tensors = {f"{i}.weight": torch.randn(128, 256, generator=gen).to(torch.bfloat16) for i in range(4)}
    base = write_safetensors(os.path.join(tmp_path, "base.safetensors"), tensors)
    changes = {str(i): lora_change(128, 256, 4, seed=i, alpha=4) for i in range(4)}
    adapter = write_adapter(tmp_path / "lora.safetensors", "kohya", changes)
    model = nn.Sequential(*(nn.Linear(256, 128, bias=False) for _ in range(4)))
    for name, tensor in load_readonly(base).items():
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
    root = str(tmp_path / "cache")
    assert lora_cache.merge(model, [adapter], cache_root=root, base_files=[base], progress=False,
                            rounding="merge").built == 4
    done = run_python(_HIT, base, str(adapter), root)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["hit"] == 4
    assert found["imported"] == [], f"a hit imported {found['imported']} inside merge"
