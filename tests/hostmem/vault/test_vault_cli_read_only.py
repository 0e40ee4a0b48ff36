"""``hostmem cache`` on a root this user cannot change: a cache baked into an image and mounted
read-only. What it refuses, and what it advises, are what can be done there."""

from __future__ import annotations

import json
import os

import pytest

from hostmem.safetensors.mapping import read_header
from hostmem.vault.layer_file import layer_file_name
from tests.hostmem.vault.test_vault_cli import build, cli


@pytest.mark.parametrize("action", [["rm", "KEY"], ["prune", "--all"]], ids=["rm", "prune"])
def test_rm_and_prune_of_a_read_only_root_say_it_is_an_image_that_cannot_be_changed(tmp_path, capsys, read_only_copy,
                                                                                    action):
    root = str(tmp_path / "image-build")
    key = build(root, "baked", tmp_path)
    baked = read_only_copy(root)
    argv = [key.hex[:10] if a == "KEY" else a for a in action]
    code, out, err = cli(capsys, "cache", *argv, "--root", baked)
    assert code == 2 and out == ""
    assert err.splitlines() == [
        f"hostmem: error: {baked}: a read-only root (a cache baked into an image, or a read-only mount) cannot be "
        f"changed; run `hostmem cache {action[0]}` where the image is built, before its root is made read-only, or "
        "give a writable root (--root DIR, HOSTMEM_CACHE_ROOT)"]
    code, out, _ = cli(capsys, "cache", "ls", "--root", baked, "--json")
    assert code == 0 and [c["key"] for c in json.loads(out)["combinations"]] == [key.hex]


def test_verify_of_a_read_only_root_with_damage_advises_what_can_be_done_there(tmp_path, capsys, read_only_copy):
    """It advised `hostmem cache rm` and `prune`, both refused on a root that cannot be changed."""
    root = str(tmp_path / "image-build")
    key = build(root, "baked", tmp_path)
    baked = read_only_copy(root)
    path = os.path.join(root, "lora_merge_cache", key.hex, layer_file_name("blocks.1.w"))
    offset = read_header(path).data_offset + 100
    with open(path, "r+b") as handle:  # damaged where the image is built: the read-only mount shows it
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))
    code, out, _ = cli(capsys, "cache", "verify", "--root", baked)
    assert code == 1 and "content checksum differs" in out
    assert "cache rm" not in out and "cache prune" not in out
    assert f"1 damaged combination(s) ({key.short}) in {baked}, which this user cannot change" in out
    assert "rebuild the image where it is built" in out
