"""Changes below the filesystem: what the stamp memo cannot see, and ``verify --deep``.

The base lives on a real ext4 image, loop-mounted; one byte of it is rewritten in the
image file itself while it is mounted (as a disk written through its device would be),
so the file's device, inode, size, mtime and ctime all stay as they were. A start then
serves the merge of the old bytes (the documented limit of the stamp memo);
``hostmem cache verify --deep`` names the changed input and drops its memoised digest,
and the next start serves the merge of what the base holds now.
"""

from __future__ import annotations

import os
import subprocess
import sys

from hostmem.vault.content_hash import stamp_of
from planners.cli import main
from tests.conftest import drop_page_cache
from tests.faults.test_folded_hash import fresh_start
from tests.faults.test_full_disk_rekey import small_disk
from tests.faults.world import COLS, LAYERS, ROWS, assert_same, make_world, reference
from tests.lora_cache.test_adapters import lora_change, write_adapter

_BLOCK = 4096


def rewrite_under_the_filesystem(image: str, path: str, offset: int) -> None:
    """Flip the byte at ``offset`` of ``path`` by writing the image its filesystem lives
    in, not the file: the filesystem is not told, the file's stamp stays."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())  # its blocks are in the image before the image is read
        data = handle.read()
    block = data[offset // _BLOCK * _BLOCK:(offset // _BLOCK + 1) * _BLOCK]
    with open(image, "rb") as handle:
        disk = handle.read()
    at = disk.find(block)
    assert at >= 0 and at % _BLOCK == 0 and disk.find(block, at + 1) < 0, "the block is not found once in the image"
    at += offset % _BLOCK
    fd = os.open(image, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([disk[at] ^ 0xFF]), at)
        os.fsync(fd)
    finally:
        os.close(fd)
    drop_page_cache(path)  # the file's pages are read from the image again


def test_verify_deep_finds_a_base_changed_below_the_filesystem(tmp_path, capsys):
    with small_disk(tmp_path) as disk:
        world = make_world(os.path.join(disk, "world"))
        root = str(tmp_path / "root")
        old = reference(world.base, world.adapter)
        served, _ = fresh_start(world.base, world.adapter, root)
        assert_same(served, old)
        assert main(["cache", "verify", "--deep", "--root", root]) == 0  # nothing changed: the adapter's file
        assert "changed below" not in capsys.readouterr().out  # digest is compared, not the meaning it keys by
        stamp = stamp_of(os.stat(world.base))
        rewrite_under_the_filesystem(str(tmp_path / "disk.img"), world.base, os.path.getsize(world.base) - 2)
        assert stamp_of(os.stat(world.base)) == stamp
        new = reference(world.base, world.adapter)
        assert any(not old[n].equal(new[n]) for n in old), "the rewrite did not reach the file"
        served, _ = fresh_start(world.base, world.adapter, root)
        assert_same(served, old)  # what the stamp memo cannot see: the merge of the old bytes
        capsys.readouterr()
        assert main(["cache", "verify", "--root", root]) == 0  # every layer is the right merge of its key
        assert main(["cache", "verify", "--deep", "--root", root]) == 1
        out = capsys.readouterr().out
        assert world.base in out and "changed below the filesystem" in out, out
        assert "damaged" not in out and "they stay (the right merge of the bytes their keys name)" in out, out
        served, stats = fresh_start(world.base, world.adapter, root)
        assert_same(served, new)
        assert stats.built == LAYERS


def test_verify_deep_notes_an_adapter_replaced_by_a_new_version_and_exits_0(tmp_path):
    """A new version renamed over the adapter (a new inode and mtime) is what a start sees and
    hashes anew: the combination still serves the bytes its key names, so it is a note naming
    the file and the `rm` to run if that version is gone for good, not damage."""
    world = make_world(tmp_path / "world")
    root = str(tmp_path / "root")
    fresh_start(world.base, world.adapter, root)
    changes = {f"blocks.{i}.proj": lora_change(ROWS, COLS, 4, i + 1, alpha=2) for i in range(LAYERS)}
    newer = write_adapter(str(tmp_path / "turbo-v2.safetensors"), "comfyui", changes)
    when = os.stat(world.adapter).st_mtime_ns + 10**9
    os.utime(newer, ns=(when, when))
    os.replace(newer, world.adapter)
    verify = [sys.executable, "-m", "planners.cli", "cache", "verify", "--deep", "--root", root]
    done = subprocess.run(verify, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{world.adapter} was replaced since this combination was built" in done.stdout, done.stdout
    assert "`hostmem cache rm " in done.stdout and "if that version is no longer used" in done.stdout
    assert "below the filesystem" not in done.stdout and "damaged" not in done.stdout
    assert done.stderr == ""
