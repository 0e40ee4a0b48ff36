"""Safetensors headers, read without the weights and without torch.

What a planner needs before anything is loaded: each tensor's dtype, shape and byte
range, and a hash of the header for cache keys. Reading one costs a few KiB of I/O,
so the headers of a 60 GB checkpoint read in milliseconds, and importing this
module does not import torch.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from dataclasses import dataclass, field
from functools import cached_property
from math import prod

from .dtypes import DTYPE_SIZES, torch_dtypes
from ..errors import HostmemError

__all__ = ["DTYPE_SIZES", "SafetensorsError", "TensorInfo", "SafetensorsHeader", "read_header"]

_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsError(HostmemError, ValueError):
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
        return torch_dtypes()[self.dtype]


@dataclass(frozen=True)
class SafetensorsHeader:
    """The parsed header of a safetensors file: what is in it, without the weights."""

    path: str
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_offset: int
    file_size: int
    header_bytes: bytes = field(repr=False)  # the length prefix and the JSON, as in the file
    file_id: tuple[int, int] = field(default=(0, 0), repr=False)  # (device, inode) of the file read

    @cached_property
    def header_sha256(self) -> str:
        """The SHA-256 of the header's bytes, computed when first asked for: hashlib loads
        OpenSSL, which a plan that only sizes weights need not wait for."""
        import hashlib

        return hashlib.sha256(self.header_bytes).hexdigest()

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


class _DuplicateKey(Exception):
    pass


def _no_duplicates(pairs: list) -> dict:
    """A JSON object, refusing a key given twice (json keeps the last one silently)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return out


def _metadata(path: str, value) -> dict[str, str]:
    """``__metadata__``: a mapping of text to text, as the format defines it."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise SafetensorsError(f"{path}: __metadata__ must map names to text, found {_short(value)}")
    return dict(value)


def _short(value) -> str:
    shown = repr(value)
    return shown if len(shown) <= 60 else f"{shown[:50]}...({len(shown)} characters)"


def _whole(value) -> bool:
    """A JSON whole number that is not a bool (``True`` is an int to Python, not to JSON)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _entry(path: str, name: str, entry, data_size: int) -> TensorInfo:
    """One tensor's entry, each field checked for type and range before any arithmetic."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise SafetensorsError(f"{path}: tensor {name!r}: expected {{dtype, shape, data_offsets}}, found {_short(entry)}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise SafetensorsError(
            f"{path}: tensor {name!r} has unsupported dtype {_short(dtype)} (known: {', '.join(DTYPE_SIZES)})"
        )
    if not isinstance(shape, list) or not all(_whole(d) and 0 <= d < 1 << 62 for d in shape):
        raise SafetensorsError(f"{path}: tensor {name!r}: shape {_short(shape)} is not a list of whole numbers >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_whole(o) for o in offsets)):
        raise SafetensorsError(f"{path}: tensor {name!r}: data_offsets {_short(offsets)} is not [begin, end]")
    begin, end = offsets
    expected = prod(shape) * DTYPE_SIZES[dtype]
    if not 0 <= begin <= end <= data_size or end - begin != expected:
        raise SafetensorsError(
            f"{path}: tensor {name!r} spans bytes {begin}..{end} but shape {list(shape)} of "
            f"{dtype} needs {expected} within a {data_size}-byte data section "
            "(truncated or corrupt file)"
        )
    return TensorInfo(name, dtype, tuple(shape), begin, end)


def _check_layout(path: str, tensors: dict[str, TensorInfo]) -> None:
    """Tensors tile the data section from byte 0, without overlap or gap, as the format requires.

    An overlap would let two tensors share bytes (a write to one changes the other), and a
    gap hides bytes no tensor accounts for: the safetensors library refuses both.
    """
    at, previous = 0, None
    for info in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if info.begin != at and not (info.begin == info.end and info.begin <= at):
            what = f"overlaps {previous!r}" if info.begin < at else f"leaves bytes {at}..{info.begin} to no tensor"
            raise SafetensorsError(
                f"{path}: tensor {info.name!r} at bytes {info.begin}..{info.end} {what} (corrupt header)"
            )
        at, previous = max(at, info.end), info.name


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Read and validate the header of ``path`` (reads a few KiB, never the weights)."""
    path = os.fspath(path)
    try:
        # O_NONBLOCK: a FIFO (or a device) at the path would hold the open up for good; refused below
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        with open(fd, "rb") as handle:
            st = os.fstat(handle.fileno())
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError
            if not stat.S_ISREG(st.st_mode):
                raise SafetensorsError(f"{path}: not a regular file (a FIFO, socket or device); a checkpoint is a "
                                       ".safetensors file")
            file_size, file_id = st.st_size, (st.st_dev, st.st_ino)
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
    try:  # UTF-8, as the format says (json.loads of bytes would also take UTF-16 and UTF-32)
        parsed = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsError(f"{path}: header is not JSON ({exc})") from None
    except _DuplicateKey as exc:
        raise SafetensorsError(f"{path}: header names {exc.args[0]!r} twice (corrupt header)") from None
    except RecursionError:
        raise SafetensorsError(f"{path}: header nests too deeply to be a safetensors header") from None
    except ValueError as exc:  # a number past what Python parses (an integer of thousands of digits)
        raise SafetensorsError(f"{path}: header is not a safetensors header ({exc})") from None
    if not isinstance(parsed, dict):
        raise SafetensorsError(f"{path}: header is not a JSON object")
    metadata = _metadata(path, parsed.pop("__metadata__", None))
    data_offset = 8 + header_len
    data_size = file_size - data_offset
    tensors = {name: _entry(path, name, entry, data_size) for name, entry in parsed.items()}
    _check_layout(path, tensors)
    return SafetensorsHeader(
        path=path,
        tensors=tensors,
        metadata=dict(metadata),
        data_offset=data_offset,
        file_size=file_size,
        header_bytes=prefix + raw,
        file_id=file_id,
    )
