"""CRC-32: ISA-L's where installed, zlib's pieces on several cores otherwise; always zlib's value."""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest

import hostmem.crc32 as crc32_module
from hostmem.crc32 import PIECE_BYTES, crc32, crc32_combine, crc32_of


@pytest.mark.parametrize("first, second", [(0, 7), (7, 0), (1, 1), (3, 1000), (4096, 12345), (100, PIECE_BYTES)])
def test_combining_two_crcs_gives_the_crc_of_the_joined_bytes(first, second):
    a, b = os.urandom(first), os.urandom(second)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@pytest.mark.parametrize("implementation", ["installed", "zlib"])
def test_a_buffer_of_several_pieces_has_zlibs_crc_on_any_number_of_threads(implementation, monkeypatch):
    if implementation == "zlib":
        monkeypatch.setattr(crc32_module, "crc32", zlib.crc32)  # the fallback where ISA-L has no wheel
    data = bytearray(os.urandom(2 * PIECE_BYTES + 12345))  # two whole pieces and a short one
    expected = zlib.crc32(data)
    assert crc32_of(data) == expected
    with ThreadPoolExecutor(3) as pool:
        assert crc32_of(data, pool.map) == expected
    data[PIECE_BYTES + 5] ^= 1  # one flipped bit in the middle piece changes it
    assert crc32_of(data) != expected
    assert crc32_of(b"") == zlib.crc32(b"") == 0


def test_the_installed_crc32_gives_zlibs_value_from_any_start(tmp_path):
    data = os.urandom(3 * 1024 * 1024 + 17)
    view = memoryview(data)
    for start in (0, 1, 0xFFFFFFFF, zlib.crc32(b"prefix")):
        assert crc32(view, start) == zlib.crc32(view, start)
    running = 0
    for offset in range(0, len(data), 1 << 20):  # fed in order, as a write feeds it
        running = crc32(view[offset : offset + (1 << 20)], running)
    assert running == zlib.crc32(data)


def test_isal_is_the_crc32_where_its_wheel_is_declared():
    import platform

    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64"):
        pytest.skip("the isal dependency is declared for Linux x86-64 and aarch64 only")
    assert crc32_module.CRC32_IMPLEMENTATION == "isal"  # installed with the package, not left to chance
