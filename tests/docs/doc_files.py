"""The small files the examples of README.md and docs/*.md name, made in one folder.

Every name here is one a page uses as written: ``transformer.safetensors`` (a plain
checkpoint), ``flux-tiny/`` (a diffusers transformer from a tiny config, saved with
``save_pretrained``), ``turbo.safetensors`` and ``style.safetensors`` (LoRAs for it,
written by diffusers), ``my-deployment.yaml`` (a config naming them) and ``configs/``
(the repository's own). Sizes are MiB, so the whole docs test stays near a minute.
"""

from __future__ import annotations

import os
import shutil

import torch

from hostmem import save_file
from tests.clients import tiny_models as tm

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEPLOYMENT = """\
deployment: flux-tiny-4g
host:   {limit: 4GiB, reserve: 1GiB, max_pinned: 75%}
device: {vram: 0}                   # 0: no GPU here, every layer streams
transfer: {pinned_h2d: 24GB/s, pageable_h2d: 8GB/s, disk_read: 3GB/s}
workload: {steps: 4, passes_per_step: 1}
components:
  dit:
    path: flux-tiny/diffusion_pytorch_model.safetensors
    layers: ["transformer_blocks.{i}.", "single_transformer_blocks.{i}."]   # both of Flux's block families
    offload: layerwise
lora:
  adapters: [{path: turbo.safetensors, strength: 1.0}]
  cache: {root: cache, enabled: true}
"""


def make_doc_files(folder: str) -> None:
    """Write every file the examples name into ``folder`` (created if missing)."""
    os.makedirs(folder, exist_ok=True)
    torch.manual_seed(0)
    save_file({"weight": torch.randn(512, 512).to(torch.bfloat16)}, os.path.join(folder, "transformer.safetensors"))
    model = tm.save_model("flux", os.path.join(folder, "flux-tiny"), dtype=torch.bfloat16)
    for name, seed in (("turbo", 1), ("style", 2)):
        written = tm.write_adapters("flux", model, os.path.join(folder, f"_{name}"), seed=seed)
        shutil.copy(os.path.join(written["diffusers_meta"], "pytorch_lora_weights.safetensors"),
                    os.path.join(folder, f"{name}.safetensors"))
        shutil.rmtree(os.path.join(folder, f"_{name}"))
    with open(os.path.join(folder, "my-deployment.yaml"), "w") as handle:
        handle.write(DEPLOYMENT)
    shutil.copytree(os.path.join(REPO, "configs"), os.path.join(folder, "configs"))


if __name__ == "__main__":  # ``python -m tests.docs.doc_files DIR``: the README's quick starts' files
    import sys

    target = sys.argv[1] if len(sys.argv) > 1 else "."
    make_doc_files(target)
    print(f"wrote transformer.safetensors, flux-tiny/, turbo.safetensors, style.safetensors, my-deployment.yaml "
          f"and configs/ into {os.path.abspath(target)}")
