"""A full disk at the re-key of a folded build: the start merges and serves, with one warning.

The filesystem is real and small (an ext4 image, loop-mounted); it is filled for real,
with ``posix_fallocate``, at the moment the re-key is about to write the manifest under
the real key: the kernel's own ENOSPC. Skipped where this machine cannot loop-mount.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess

import pytest

from hostmem.vault import rekey as rekey_module
from hostmem.vault import session as session_module
from tests.faults.test_folded_hash import fresh_start, markers
from tests.faults.world import LAYERS, assert_same, leftovers, make_world, reference

SIZE_MIB = 320  # above the cache's 256 MiB headroom, so that the build writes at all


@contextlib.contextmanager
def small_disk(tmp_path):
    """A freshly made ext4 filesystem of :data:`SIZE_MIB` MiB (sparse), mounted; unmounted after."""
    image, mount = str(tmp_path / "disk.img"), str(tmp_path / "disk")
    os.mkdir(mount)
    with open(image, "wb") as handle:
        handle.truncate(SIZE_MIB * 1024 * 1024)
    made = subprocess.run(["mkfs.ext4", "-q", "-m", "0", "-b", "4096", image], capture_output=True, text=True)
    mounted = made.returncode == 0 and subprocess.run(
        ["mount", "-o", "loop", image, mount], capture_output=True, text=True).returncode == 0
    if not mounted:
        pytest.skip("cannot make and loop-mount a small filesystem here (needs root and a loop device)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", mount], check=True)
        os.unlink(image)


def fill(folder: str) -> str:
    """Take every free block of ``folder``'s filesystem into one file; its path."""
    path = os.path.join(folder, "filler")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        size, chunk = 0, 1 << 30
        while chunk >= 4096:
            try:
                os.posix_fallocate(fd, size, chunk)
                size += chunk
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                chunk //= 2
    finally:
        os.close(fd)
    return path


@pytest.mark.parametrize("step", ["the re-key's manifest", "the provisional seal"])
def test_a_full_disk_at_a_folded_build_serves_the_merge_with_one_warning_and_the_next_start_builds(
        tmp_path, monkeypatch, capfd, step):
    world = make_world(tmp_path / "world")
    expected = reference(world.base, world.adapter)
    module, warning = {"the re-key's manifest": (rekey_module, "could not store the build under its key"),
                       "the provisional seal": (session_module, "so the next start builds it again")}[step]
    with small_disk(tmp_path) as disk:
        root = os.path.join(disk, "root")
        real_write, filled = module.write_manifest, []

        def write_on_a_full_disk(folder, manifest):
            if not filled:
                filled.append(fill(disk))
            return real_write(folder, manifest)

        monkeypatch.setattr(module, "write_manifest", write_on_a_full_disk)
        capfd.readouterr()
        served, stats = fresh_start(world.base, world.adapter, root)
        said = capfd.readouterr().err
        assert filled, "the build was not folded: nothing was re-keyed"
        assert_same(served, expected)
        assert said.count(warning) == 1, said
        assert "No space left on device" in said
        assert markers(root) == [] and leftovers(root) == []
        monkeypatch.undo()
        os.unlink(filled[0])
        served, stats = fresh_start(world.base, world.adapter, root)
        assert_same(served, expected)
        assert stats.built == LAYERS
        served, stats = fresh_start(world.base, world.adapter, root)
        assert_same(served, expected)
        assert stats.hit == LAYERS
