"""The merge policy: how the build sums a layer, in the words the combination's key records.

The build knows how it sums (the device, the kernel chosen for each shape class, how
torch runs fp32 matmuls in this process), so it says so here, once per merge; the key
(:mod:`lora_cache.key.combination`) takes the string as it is handed and never asks the
build back.
"""

from __future__ import annotations

import torch

from ..compute.buffers import compute_device
from .plan import KernelPlan
from .precision import fp32_matmul_precision

__all__ = ["MERGE_POLICY", "merge_policy"]

MERGE_POLICY = "fp32-sum-in-row-blocks-in-adapter-order-cast-once-v3"  # change when merged bytes would change


def merge_policy(device: torch.device | str | None = None, kernels: KernelPlan | None = None, sharding: str = "",
                 rounding: str = "runtime") -> str:
    """The merge policy as the key records it: :data:`MERGE_POLICY` on the compute device's
    type, the kernel chosen for each shape class that has a choice, and how torch runs
    fp32 matmuls on that device where this process lets it narrow them (TF32, bf16).

    The same fp32 sum can round differently on a GPU (its addmm) and on the CPU, the
    CPU's kernels differ in the last bit of a few elements, and a narrowed fp32 matmul
    rounds an fp32 adapter's factors, so a cache built one way is never served to starts
    that would merge another (see :mod:`lora_cache.kernels`). ``sharding`` names the
    tensor-parallel part the layers are (:meth:`lora_cache.ranks.tp_shards.Shard.describe`).
    A merge that merges lossy layers anyway (``rounding="merge"``) is keyed apart: a start
    under the default policy that plans from conversion records cannot measure, and must
    never find those layers merged (:mod:`lora_cache.placement.rounding`).
    """
    device = torch.device(device) if device is not None else compute_device()
    chosen = kernels.describe() if kernels is not None else ""
    narrowed = fp32_matmul_precision(device.type)
    policy = (f"{MERGE_POLICY}@{device.type}" + (f"+{chosen}" if chosen else "")
              + ("" if narrowed == "ieee" else f"+fp32-matmul={narrowed}"))
    policy += f"+{sharding}" if sharding else ""
    return policy + ("" if rounding == "runtime" else f"+rounding={rounding}")
