"""The identity hash: BLAKE3 of every byte, named by its algorithm, read by a thread ahead of the hash."""

from __future__ import annotations

import hashlib
import json
import os
import threading

import blake3
import pytest

from hostmem.vault.content_hash import ContentHashMemo, file_digest, read_chunks, stamp_of
from tests.conftest import run_python
from tests.fresh_fork import TORCH

SPAN = 4 * 1024 * 1024  # several of the hash reader's 1 MiB buffers


def test_an_empty_file_gives_blake3s_published_digest(tmp_path):
    path = tmp_path / "empty.bin"
    path.write_bytes(b"")
    assert file_digest(str(path)) == "blake3:af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"


def test_the_digest_is_blake3_of_every_byte_in_order_across_reads(tmp_path):
    data = os.urandom(2 * SPAN + 12345)  # a whole number of reads and a tail
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    assert file_digest(str(path)) == "blake3:" + blake3.blake3(data).hexdigest()


def test_a_byte_anywhere_or_the_length_changes_the_digest(tmp_path):
    path = tmp_path / "big.bin"
    size = 2 * SPAN + 10
    path.write_bytes(bytes(size))
    digests = {file_digest(str(path))}
    for offset in (0, SPAN + 7, 2 * SPAN + 9):
        data = bytearray(size)
        data[offset] = 1
        path.write_bytes(bytes(data))
        digests.add(file_digest(str(path)))
    path.write_bytes(bytes(size + 1))
    digests.add(file_digest(str(path)))
    assert len(digests) == 5


@pytest.mark.parametrize("buffers", [1, 3])
def test_read_chunks_delivers_exactly_the_range_asked(tmp_path, buffers):
    data = os.urandom(3 * 1024 * 1024 + 17)
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    got = bytearray()
    fd = os.open(path, os.O_RDONLY)
    try:
        read_chunks(fd, 4097, len(data) - 5, got.extend, buffers=buffers, chunk=1024 * 1024)
    finally:
        os.close(fd)
    assert bytes(got) == data[4097 : len(data) - 5]


def _read_ahead_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "hostmem-read-ahead"]


def test_a_file_truncated_while_it_is_read_is_an_error_and_the_reader_stops(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(8 * 1024 * 1024))
    fd = os.open(path, os.O_RDONLY)

    def consume(chunk):
        os.truncate(path, 1024 * 1024)  # someone rewrites the file under the hash

    try:
        with pytest.raises(OSError, match="shrank while it was being read"):
            read_chunks(fd, 0, 8 * 1024 * 1024, consume, buffers=3, chunk=1024 * 1024)
    finally:
        os.close(fd)
    assert not _read_ahead_threads()


def test_an_error_in_the_hash_stops_the_reader(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(8 * 1024 * 1024))
    fd = os.open(path, os.O_RDONLY)

    def consume(chunk):
        raise KeyboardInterrupt  # Ctrl-C during a first start's hash

    try:
        with pytest.raises(KeyboardInterrupt):
            read_chunks(fd, 0, 8 * 1024 * 1024, consume, buffers=3, chunk=1024 * 1024)
    finally:
        os.close(fd)
    assert not _read_ahead_threads()


def test_a_memo_made_with_another_hash_is_not_a_hit(tmp_path):
    """A memo file of the sha256 tree hash, its stamps matching: the file is hashed again."""
    path = tmp_path / "turbo.safetensors"
    path.write_bytes(b"adapter bytes")
    stamp = stamp_of(os.stat(path))
    memo_file = tmp_path / "content_hashes.json"
    old = {"hash": "sha256-tree-64MiB", "files": {f"{stamp[0]}:{stamp[1]}": {"stamp": stamp, "digest": "0" * 64}}}
    memo_file.write_text(json.dumps(old))
    memo = ContentHashMemo()
    digest = memo.digest(str(path), str(memo_file))
    assert digest == "blake3:" + blake3.blake3(b"adapter bytes").hexdigest()
    assert (memo.computed, memo.hits) == (1, 0)
    assert json.loads(memo_file.read_text())["hash"] == "blake3"
    assert ContentHashMemo().digest(str(path), str(memo_file)) == digest  # the rewritten memo hits


def test_without_blake3_the_same_reader_gives_a_sha256_that_says_so(tmp_path):
    """Where the module cannot be imported (no wheel), digests are sha256 and a blake3 memo is not taken."""
    data = os.urandom(SPAN + 99)
    path = tmp_path / "base.safetensors"
    path.write_bytes(data)
    memo_file = tmp_path / "content_hashes.json"
    ContentHashMemo().digest(str(path), str(memo_file))  # a memo made with blake3
    code = """
        import sys
        sys.modules["blake3"] = None  # import blake3 now raises ImportError
        from hostmem.vault.content_hash import ContentHashMemo
        memo = ContentHashMemo()
        print(memo.digest(sys.argv[1], sys.argv[2]), memo.computed)
    """
    done = run_python(code, str(path), str(memo_file), forked_from=TORCH)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["sha256:" + hashlib.sha256(data).hexdigest(), "1"]


def test_a_start_whose_digests_are_memoised_never_loads_blake3(tmp_path):
    path = tmp_path / "base.safetensors"
    path.write_bytes(os.urandom(SPAN))
    memo_file = tmp_path / "content_hashes.json"
    digest = ContentHashMemo().digest(str(path), str(memo_file))
    code = """
        import sys
        from hostmem.vault import Vault
        from hostmem.vault.content_hash import ContentHashMemo
        memo = ContentHashMemo()
        print(memo.digest(sys.argv[1], sys.argv[2]), memo.hits, "blake3" in sys.modules)
    """
    done = run_python(code, str(path), str(memo_file), forked_from=TORCH)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [digest, "1", "False"]
