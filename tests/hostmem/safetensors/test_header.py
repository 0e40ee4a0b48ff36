"""Safetensors headers: every malformed header gives SafetensorsError naming file and tensor.

Files are real files written byte by byte (length prefix, JSON, data), so the reader
sees exactly what a corrupt or hostile file would hand it.
"""

import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hostmem.safetensors.header import DTYPE_SIZES, SafetensorsError, read_header

_SETTINGS = settings(
    database=None, deadline=None, max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def write(path, header, data: bytes = b"", raw: bytes | None = None) -> str:
    """Write a safetensors file from a header (a dict, or ``raw`` JSON bytes) and data."""
    body = raw if raw is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return str(path)


def entry(dtype="F32", shape=(2,), begin=0, end=8):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


def test_a_valid_header_is_read(tmp_path):
    header = {"__metadata__": {"format": "pt"}, "b": entry(begin=8, end=16), "a": entry()}
    info = read_header(write(tmp_path / "ok.safetensors", header, bytes(16)))
    assert info.tensors["b"].begin == 8 and info.tensors["a"].shape == (2,)
    assert info.metadata == {"format": "pt"} and info.data_bytes == 16


@pytest.mark.parametrize(
    "bad, words",
    [
        ({"w": entry(dtype=["F32"])}, "unsupported dtype"),
        ({"w": entry(dtype=4)}, "unsupported dtype"),
        ({"w": entry(dtype="F33")}, "unsupported dtype"),
        ({"w": {**entry(), "shape": "2"}}, "shape"),
        ({"w": {**entry(), "shape": [2.0]}}, "shape"),
        ({"w": {**entry(), "shape": [True, 2]}}, "shape"),
        ({"w": {**entry(), "shape": [-2]}}, "shape"),
        ({"w": {**entry(), "data_offsets": ["0", "8"]}}, "data_offsets"),
        ({"w": {**entry(), "data_offsets": [0.0, 8.0]}}, "data_offsets"),
        ({"w": {**entry(), "data_offsets": [0, 8, 16]}}, "data_offsets"),
        ({"w": {**entry(), "data_offsets": None}}, "data_offsets"),
        ({"w": {"dtype": "F32", "shape": [2]}}, "expected {dtype, shape, data_offsets}"),
        ({"w": [1, 2]}, "expected {dtype, shape, data_offsets}"),
        ({"w": entry(begin=8, end=0)}, "spans bytes 8..0"),
        ({"w": entry(begin=0, end=8), "v": entry(begin=4, end=12)}, "overlaps"),
        ({"w": entry(begin=0, end=8), "v": entry(begin=0, end=8)}, "overlaps"),
        ({"w": entry(begin=8, end=16)}, "leaves bytes 0..8 to no tensor"),
        ({"__metadata__": {"n": 1}, "w": entry()}, "__metadata__"),
        ({"__metadata__": [], "w": entry()}, "__metadata__"),
    ],
)
def test_a_malformed_entry_is_named(tmp_path, bad, words):
    path = write(tmp_path / "bad.safetensors", bad, bytes(16))
    with pytest.raises(SafetensorsError) as info:
        read_header(path)
    message = str(info.value)
    assert message.startswith(path) and words in message
    named = [name for name in bad if name != "__metadata__"]
    assert "__metadata__" in message or any(repr(name) in message for name in named)


def test_a_duplicate_name_and_deep_nesting_are_refused(tmp_path):
    dup = write(tmp_path / "dup.safetensors", None, bytes(8), raw=b'{"w": %s, "w": %s}' % (
        json.dumps(entry()).encode(), json.dumps(entry()).encode()))
    with pytest.raises(SafetensorsError, match="names 'w' twice"):
        read_header(dup)
    deep = write(tmp_path / "deep.safetensors", None, raw=b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(SafetensorsError, match="nests too deeply|not JSON"):
        read_header(deep)


def test_a_header_of_another_encoding_or_an_endless_number_is_refused(tmp_path):
    """The format's header is UTF-8 JSON: UTF-16 is refused (json would take it from bytes),
    and an integer past what Python parses is a SafetensorsError, not a bare ValueError."""
    body = json.dumps({"w": entry()})
    utf16 = write(tmp_path / "utf16.safetensors", None, bytes(8), raw=body.encode("utf-16"))
    with pytest.raises(SafetensorsError, match="not JSON"):
        read_header(utf16)
    endless = write(tmp_path / "endless.safetensors", None, bytes(8),
                    raw=b'{"w": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 8]}}')
    with pytest.raises(SafetensorsError, match="endless.safetensors: header is not a safetensors header"):
        read_header(endless)


def _raises_only_safetensors_error(path: str) -> None:
    try:
        read_header(path)
    except SafetensorsError as exc:
        assert str(exc).startswith(path)


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
_fields = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.sampled_from(sorted(DTYPE_SIZES)) | _json,
        "shape": st.lists(st.integers(-3, 2**64), max_size=4) | _json,
        "data_offsets": st.lists(st.integers(-(2**64), 2**64), min_size=2, max_size=2) | _json,
    },
)


@_SETTINGS
@given(header=st.dictionaries(st.text(max_size=8), _fields | _json, max_size=5), data=st.binary(max_size=64))
def test_any_header_gives_a_header_or_a_safetensors_error(tmp_path, header, data):
    _raises_only_safetensors_error(write(tmp_path / "fuzz.safetensors", header, data))


@_SETTINGS
@given(raw=st.binary(max_size=200))
def test_any_bytes_give_a_header_or_a_safetensors_error(tmp_path, raw):
    path = tmp_path / "raw.safetensors"
    path.write_bytes(raw)
    _raises_only_safetensors_error(str(path))


@_SETTINGS
@given(
    sizes=st.lists(st.tuples(st.sampled_from(["F32", "BF16", "U8"]), st.integers(0, 5)), min_size=1, max_size=6),
    shift=st.integers(-12, 12),
    which=st.integers(0, 5),
)
def test_contiguous_layouts_read_and_any_shift_is_caught(tmp_path, sizes, shift, which):
    """Tensors laid end to end read back; moving one tensor's span leaves a gap or an overlap."""
    header, at = {}, 0
    for i, (dtype, count) in enumerate(sizes):
        nbytes = count * DTYPE_SIZES[dtype]
        header[f"t{i}"] = entry(dtype, (count,), at, at + nbytes)
        at += nbytes
    path = write(tmp_path / "layout.safetensors", header, bytes(at + 16))
    assert read_header(path).data_bytes == at
    moved = header[f"t{which % len(sizes)}"]
    begin, end = moved["data_offsets"]
    if shift == 0 or begin == end:
        return
    moved["data_offsets"] = [begin + shift, end + shift]
    path = write(tmp_path / "moved.safetensors", header, bytes(at + 16))
    if begin + shift < 0:
        with pytest.raises(SafetensorsError, match="spans bytes"):
            read_header(path)
    elif len(sizes) > 1 or begin + shift > 0:
        with pytest.raises(SafetensorsError, match="overlaps|to no tensor"):
            read_header(path)


def test_a_fifo_or_a_folder_named_like_a_checkpoint_is_refused_without_waiting(tmp_path):
    """A FIFO's open waits for a writer: `hostmem plan` of a folder holding one hung for good."""
    import os

    fifo = tmp_path / "diffusion_pytorch_model.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(SafetensorsError, match="not a regular file"):
        read_header(fifo)
    with pytest.raises(SafetensorsError, match="is a folder"):
        read_header(tmp_path)
