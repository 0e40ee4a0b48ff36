"""The process's settings that change what a kernel computes, or how fast, on this machine.

Two kinds, both read at the moment of asking, never changed:

- :func:`fp32_matmul_precision`: whether torch may run an fp32 matmul in a narrower
  format inside (TF32 on a GPU, bf16 or TF32 in oneDNN on a CPU). Servers often allow
  it (``torch.set_float32_matmul_precision("high")``, ``allow_tf32 = True``) for their
  own speed, and it changes the merged bytes of an fp32 adapter: the cache key names it
  where it is not IEEE, so a start with other settings is never served those bytes.
- :func:`instruction_caps`: the environment variables that cap the instructions torch's
  kernels use on a CPU that has more (``ATEN_CPU_CAPABILITY=avx2``, oneDNN's and MKL's
  own). A kernel timing, or a fact about how a kernel rounds, learned under one cap holds
  only under the same, so the kernel wisdom keys its entries by them where any is set.
"""

from __future__ import annotations

import os

import torch

__all__ = ["INSTRUCTION_CAPS", "fp32_matmul_precision", "instruction_caps"]

INSTRUCTION_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                    "MKL_CBWR", "ONEDNN_DEFAULT_FPMATH_MODE")
_IEEE = ("none", "ieee", "highest")


def _backend_precision(backend) -> str | None:
    """``backend.matmul.fp32_precision`` (torch 2.9 and later), falling back to the
    generic ``torch.backends.fp32_precision`` where the backend's is "none"; None where
    this torch has neither."""
    value = getattr(getattr(backend, "matmul", None), "fp32_precision", None)
    if value is None:
        return None
    if value == "none":
        value = getattr(torch.backends, "fp32_precision", "none")
    return str(value)


def fp32_matmul_precision(device_type: str) -> str:
    """How torch runs an fp32 matmul on ``device_type`` in this process: "ieee", or the
    narrower format it may use inside ("tf32", "bf16", or the legacy names "high",
    "medium" on a torch before 2.9)."""
    backend = torch.backends.cuda if device_type == "cuda" else torch.backends.mkldnn
    try:
        value = _backend_precision(backend)
        if value is None:  # the legacy switches
            if device_type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
                return "tf32"
            value = torch.get_float32_matmul_precision()
    except RuntimeError as exc:  # a torch that refuses to answer (mixed legacy and new settings)
        return f"unknown ({str(exc).split(',')[0]})"
    return "ieee" if value in _IEEE else value


def instruction_caps() -> dict[str, str]:
    """The :data:`INSTRUCTION_CAPS` set in this process's environment, by name."""
    return {name: os.environ[name] for name in INSTRUCTION_CAPS if os.environ.get(name)}
