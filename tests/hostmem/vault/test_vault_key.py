"""The cache key: each input changes it, any byte changed anywhere changes it, touches and copies keep it, digests are memoised."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch

from hostmem import load_readonly

from hostmem.vault import Vault
from hostmem.vault.content_hash import ContentHashMemo
from hostmem.vault.identity import FORMAT_VERSION, adapter_identity, base_identity, cache_key
from tests.conftest import run_python, write_safetensors
from tests.fresh_fork import TORCH


def shards(tmp_path) -> list[str]:
    return [
        write_safetensors(tmp_path / "base-1.safetensors", {"blocks.0.w": torch.ones(16, 16)}),
        write_safetensors(tmp_path / "base-2.safetensors", {"blocks.1.w": torch.ones(16, 16)}),
    ]


def adapter(tmp_path, name="turbo.safetensors", fill=1.0) -> str:
    return write_safetensors(tmp_path / name, {"lora_A": torch.full((4, 16), fill), "lora_B": torch.full((16, 4), fill)})


def key(base, adapters, dtype="bfloat16", policy="fp32-sum"):
    return cache_key(base, adapters, dtype, policy).hex


def test_every_input_changes_the_key(tmp_path):
    base, memo = base_identity(shards(tmp_path)), ContentHashMemo()
    path = adapter(tmp_path)
    one = adapter_identity(path, 1.0, None, memo=memo)
    reference = key(base, [one])
    assert len(reference) == 64 and reference == key(base, [adapter_identity(path, 1, None, memo=memo)])
    other_base = base_identity(shards(tmp_path)[:1])
    second = adapter_identity(adapter(tmp_path, "style.safetensors", 2.0), 1.0, None, memo=memo)
    variants = {
        "base": key(other_base, [one]),
        "strength": key(base, [adapter_identity(path, 0.5, None, memo=memo)]),
        "alpha": key(base, [adapter_identity(path, 1.0, 8.0, memo=memo)]),
        "dtype": key(base, [one], dtype="float16"),
        "policy": key(base, [one], policy="other"),
        "format": cache_key(base, [one], "bfloat16", "fp32-sum", format_version=FORMAT_VERSION + 1).hex,
        "more adapters": key(base, [one, second]),
        "adapter order": key(base, [second, one]),
        "extra input": key(base, [dict(one, rules=[["^x", "y"]])]),
    }
    assert reference not in variants.values()
    assert len(set(variants.values())) == len(variants)
    assert cache_key(base, [one], "torch.bfloat16", "fp32-sum").hex == reference


def test_shard_order_and_adapter_location_do_not_change_the_key(tmp_path):
    paths = shards(tmp_path)
    assert base_identity(paths) == base_identity(paths[::-1])
    memo = ContentHashMemo()
    original = adapter(tmp_path)
    copy = shutil.copy(original, tmp_path / "copied-elsewhere.safetensors")
    base = base_identity(paths)
    assert key(base, [adapter_identity(original, 1.0, None, memo=memo)]) == key(
        base, [adapter_identity(copy, 1.0, None, memo=memo)]
    )


def _wait_for_a_later_ctime(path: str) -> None:
    """Wait until a file changed now gets a later ctime than ``path`` (the kernel's clock is coarse)."""
    probe = f"{path}.clock"
    while True:
        with open(probe, "w"):
            pass
        if os.stat(probe).st_ctime_ns > os.stat(path).st_ctime_ns:
            break
        time.sleep(0.001)
    os.unlink(probe)


@pytest.mark.parametrize("how", ["replaced", "rewritten in place"])
def test_a_base_shard_with_new_values_under_the_same_names_size_and_mtime_changes_the_key(tmp_path, how):
    """Same names, shapes and size, so the same header; the mtime forged back: only the values differ."""
    path = write_safetensors(tmp_path / "base.safetensors", {"blocks.0.a": torch.ones(8, 8)})
    before = os.stat(path)
    identity = base_identity([path])
    _wait_for_a_later_ctime(path)
    new = write_safetensors(tmp_path / "new.safetensors", {"blocks.0.a": torch.full((8, 8), 2.0)})
    if how == "replaced":
        os.replace(new, path)
    else:
        with open(path, "r+b") as handle, open(new, "rb") as source:
            handle.write(source.read())
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert torch.equal(load_readonly(path)["blocks.0.a"], torch.full((8, 8), 2.0))
    after = base_identity([path])
    shard_before, shard_after = identity["shards"][0], after["shards"][0]
    same = ("path", "size", "mtime_ns")
    assert [shard_before[k] for k in same] == [shard_after[k] for k in same]
    assert key(identity, []) != key(after, [])


@pytest.mark.parametrize("how", ["copied with its mtime", "copied elsewhere", "touched", "moved"])
def test_a_base_with_the_same_bytes_keeps_the_key(tmp_path, how):
    """An image layer unpacked on another host, a ``touch``, a ``cp``, a ``mv``: same bytes, same key."""
    path = write_safetensors(tmp_path / "base.safetensors", {f"blocks.{i}.w": torch.randn(64, 256) for i in range(4)})
    identity = base_identity([path])
    _wait_for_a_later_ctime(path)
    if how == "copied with its mtime":
        shutil.copy2(path, tmp_path / "copy.safetensors")
        os.replace(tmp_path / "copy.safetensors", path)
    elif how == "copied elsewhere":
        os.mkdir(tmp_path / "elsewhere")
        path = shutil.copy(path, tmp_path / "elsewhere" / "renamed.safetensors")
    elif how == "touched":
        os.utime(path)
    else:
        path = shutil.move(path, tmp_path / "moved.safetensors")
    assert key(base_identity([path]), []) == key(identity, [])


def test_a_byte_changed_outside_every_sampled_page_changes_the_key(tmp_path):
    """A byte in the middle of a tensor's data, 5 KiB from its ends and middle, mtime put back."""
    path = write_safetensors(tmp_path / "base.safetensors", {"blocks.0.w": torch.zeros(64, 1024)})
    before, identity = os.stat(path), base_identity([path])
    with open(path, "r+b") as handle:
        handle.seek(before.st_size - 64 * 1024 * 4 // 4 - 5000)
        handle.write(b"\x01")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert key(base_identity([path]), []) != key(identity, [])


def test_one_changed_tensor_in_a_large_shard_changes_the_key(tmp_path):
    tensors = {f"blocks.{i}.w": torch.randn(256, 1024) for i in range(16)}  # 16 MiB
    path = write_safetensors(tmp_path / "base.safetensors", tensors)
    before, identity = os.stat(path), base_identity([path])
    tensors["blocks.11.w"] = tensors["blocks.11.w"] + 1.0  # a fine-tune of one layer
    write_safetensors(path, tensors)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert key(base_identity([path]), []) != key(identity, [])


def test_a_same_size_adapter_with_the_old_mtime_is_rehashed_and_changes_the_key(tmp_path):
    memo = ContentHashMemo()
    path = adapter(tmp_path, fill=1.0)
    before = os.stat(path)
    first = adapter_identity(path, 1.0, None, memo=memo)
    with open(path, "r+b") as handle:  # rewrite in place: same inode, same size, new bytes
        handle.write(open(adapter(tmp_path, "other.safetensors", fill=2.0), "rb").read())
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    second = adapter_identity(path, 1.0, None, memo=memo)
    assert (first["size"], first["mtime_ns"]) == (second["size"], second["mtime_ns"])
    assert first["digest"] != second["digest"] and memo.computed == 2
    base = base_identity(shards(tmp_path))
    assert key(base, [first]) != key(base, [second])


def test_an_unchanged_adapter_is_not_rehashed_in_process(tmp_path):
    memo = ContentHashMemo()
    path = adapter(tmp_path)
    first = adapter_identity(path, 1.0, None, memo=memo)
    for strength in (0.5, 1.0, 2.0):
        assert adapter_identity(path, strength, None, memo=memo)["digest"] == first["digest"]
    assert (memo.computed, memo.hits) == (1, 3)


def test_the_on_disk_memo_spares_a_new_process_the_rehash(tmp_path):
    vault = Vault(tmp_path / "root")
    path = adapter(tmp_path)
    digest = vault.adapter_identity(path, 1.0, None)["digest"]
    with open(vault.memo_file) as handle:
        st = os.stat(path)
        assert json.load(handle)["files"][f"{st.st_dev}:{st.st_ino}"]["digest"] == digest
    code = """
        import sys
        from hostmem.vault import Vault
        from hostmem.vault.content_hash import CONTENT_HASH_MEMO as memo
        identity = Vault(sys.argv[1]).adapter_identity(sys.argv[2], 1.0, None)
        print(identity["digest"], memo.computed, memo.hits)
    """
    done = run_python(code, str(tmp_path / "root"), path, forked_from=TORCH)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [digest, "0", "1"]
    with open(path, "ab") as handle:  # a changed file is hashed again, memo or not
        handle.write(b" ")
    done = run_python(code, str(tmp_path / "root"), path, forked_from=TORCH)
    assert done.stdout.split()[1:] == ["1", "0"]
