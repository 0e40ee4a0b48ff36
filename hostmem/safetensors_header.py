"""Safetensors headers, read without the weights and without torch.

What a planner needs before anything is loaded: each tensor's dtype, shape and byte
range, and a hash of the header for cache keys. Reading one costs a few KiB of I/O,
so the headers of a 60 GB checkpoint read in milliseconds, and importing this
module does not import torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from math import prod

__all__ = ["DTYPE_SIZES", "SafetensorsError", "TensorInfo", "SafetensorsHeader", "read_header"]

DTYPE_SIZES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E5M2": 1,
}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    """A file is not a valid safetensors file; the message names it and says why."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in a header. Offsets are relative to the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def torch_dtype(self):
        """The torch dtype (imports torch; the rest of this module does not)."""
        from .safetensors_map import DTYPES

        return DTYPES[self.dtype]


@dataclass(frozen=True)
class SafetensorsHeader:
    """The parsed header of a safetensors file: what is in it, without the weights."""

    path: str
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_offset: int
    file_size: int
    header_sha256: str

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Read and validate the header of ``path`` (reads a few KiB, never the weights)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as handle:
            file_size = os.fstat(handle.fileno()).st_size
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise SafetensorsError(f"{path}: too short to be a safetensors file ({file_size} bytes)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > _MAX_HEADER or 8 + header_len > file_size:
                raise SafetensorsError(
                    f"{path}: header length {header_len} does not fit a {file_size}-byte file "
                    "(truncated or not safetensors)"
                )
            raw = handle.read(header_len)
    except FileNotFoundError:
        raise SafetensorsError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise SafetensorsError(f"{path}: is a folder, expected a .safetensors file") from None
    except PermissionError:
        raise SafetensorsError(f"{path}: permission denied (make it readable by this user)") from None
    except OSError as exc:
        raise SafetensorsError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        parsed = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsError(f"{path}: header is not JSON ({exc})") from None
    if not isinstance(parsed, dict):
        raise SafetensorsError(f"{path}: header is not a JSON object")
    metadata = parsed.pop("__metadata__", None) or {}
    data_offset = 8 + header_len
    tensors = {}
    for name, entry in parsed.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{path}: entry {name!r} lacks dtype, shape or data_offsets") from None
        if dtype not in DTYPE_SIZES:
            raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
        expected = prod(shape) * DTYPE_SIZES[dtype]
        if end - begin != expected or begin < 0 or data_offset + end > file_size:
            raise SafetensorsError(
                f"{path}: tensor {name!r} spans bytes {begin}..{end} but shape {list(shape)} of "
                f"{dtype} needs {expected} within a {file_size - data_offset}-byte data section "
                "(truncated or corrupt file)"
            )
        tensors[name] = TensorInfo(name, dtype, shape, begin, end)
    return SafetensorsHeader(
        path=path,
        tensors=tensors,
        metadata=dict(metadata),
        data_offset=data_offset,
        file_size=file_size,
        header_sha256=hashlib.sha256(prefix + raw).hexdigest(),
    )
