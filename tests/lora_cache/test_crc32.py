"""CRC-32 in pieces on several cores: the value zlib gives the whole buffer, joined right."""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest

from lora_cache.crc32 import PIECE_BYTES, crc32_combine, crc32_of


@pytest.mark.parametrize("first, second", [(0, 7), (7, 0), (1, 1), (3, 1000), (4096, 12345), (100, PIECE_BYTES)])
def test_combining_two_crcs_gives_the_crc_of_the_joined_bytes(first, second):
    a, b = os.urandom(first), os.urandom(second)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_a_buffer_of_several_pieces_has_zlibs_crc_on_any_number_of_threads():
    data = bytearray(os.urandom(2 * PIECE_BYTES + 12345))  # two whole pieces and a short one
    expected = zlib.crc32(data)
    assert crc32_of(data) == expected
    with ThreadPoolExecutor(3) as pool:
        assert crc32_of(data, pool.map) == expected
    data[PIECE_BYTES + 5] ^= 1  # one flipped bit in the middle piece changes it
    assert crc32_of(data) != expected
    assert crc32_of(b"") == zlib.crc32(b"") == 0
