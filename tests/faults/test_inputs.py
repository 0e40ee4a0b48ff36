"""The base and the adapter: any byte changed changes the merge; same bytes keep the cache.

Timestamps are put back after every change (what ``cp -p``, ``rsync -t``, ``tar`` and
image builders leave), so only the content can tell.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from hostmem.safetensors.mapping import read_header
from tests.faults.world import LAYERS, assert_same, flip_byte_keeping_times, make_world, reference, start


@pytest.mark.parametrize("which", ["base", "adapter"])
def test_one_byte_changed_with_its_timestamps_restored_is_merged_anew(tmp_path, which):
    world = make_world(tmp_path)
    root = world.path("root")
    start(world.base, world.adapter, root)
    path = world.base if which == "base" else world.adapter
    header = read_header(path)
    flip_byte_keeping_times(path, header.file_size - 3)  # the last tensor's last bytes: outside any header
    expected = reference(world.base, world.adapter)
    served, stats = start(world.base, world.adapter, root)
    assert_same(served, expected)
    assert stats.built == LAYERS and stats.hit == 0


@pytest.mark.parametrize("how", ["touched", "copied with cp -p", "copied elsewhere", "moved"])
def test_a_base_with_the_same_bytes_hits_the_cache(tmp_path, how):
    world = make_world(tmp_path)
    expected, root = reference(world.base, world.adapter), world.path("root")
    start(world.base, world.adapter, root)
    base = world.base
    if how == "touched":
        subprocess.run(["touch", base], check=True)
    elif how == "copied with cp -p":
        os.mkdir(world.path("image"))
        base = world.path("image", "base.safetensors")
        subprocess.run(["cp", "-p", world.base, base], check=True)
    elif how == "copied elsewhere":
        os.mkdir(world.path("other"))
        base = shutil.copy(world.base, world.path("other", "dit.safetensors"))
    else:
        base = shutil.move(world.base, world.path("moved.safetensors"))
    served, stats = start(base, world.adapter, root)
    assert_same(served, expected)
    assert (stats.hit, stats.built) == (LAYERS, 0)
