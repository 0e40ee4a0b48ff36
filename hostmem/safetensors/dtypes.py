"""The safetensors dtype names: their sizes in bytes (torch-free), and their torch dtypes.

One table below the header reader and the mapping alike, so the header reader can
name a tensor's torch dtype without importing the mapping (which imports it back).
"""

from __future__ import annotations

import functools

__all__ = ["DTYPE_SIZES", "torch_dtypes"]

DTYPE_SIZES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E5M2": 1,
}


@functools.cache
def torch_dtypes() -> dict:
    """Each name's torch dtype (imports torch on the first call; sizes above never do)."""
    import torch

    table = {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
        "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
        "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    }
    assert set(table) == set(DTYPE_SIZES)
    return table
