"""Verified adoption is memoised: unchanged layer files are not re-read by the next start;
a changed one is read and checked before it is served."""

from __future__ import annotations

import os

from hostmem.vault.layer_file import layer_file_name
from tests.conftest import run_python
from tests.fresh_fork import TORCH
from tests.faults.world import LAYERS, combination_folder, make_world, start

COUNTING_START = """
import sys
import lora_cache, hostmem.vault.verification as v
from lora_cache.placement.layers import checkpoint_module
read = []
real = v.data_crc32
v.data_crc32 = lambda path: read.append(path) or real(path)
stats = lora_cache.merge(checkpoint_module([sys.argv[1]]), [sys.argv[2]], cache_root=sys.argv[3], progress=False)
print(stats.hit, stats.built, len(read))
"""


def test_a_new_process_reads_only_the_layer_files_that_changed(tmp_path):
    world = make_world(tmp_path)
    root = world.path("root")
    start(world.base, world.adapter, root)  # written here: memoised as verified
    args = (world.base, world.adapter, root)
    done = run_python(COUNTING_START, *args, forked_from=TORCH)
    assert done.stdout.split() == [str(LAYERS), "0", "0"], done.stderr[-2000:]
    path = os.path.join(combination_folder(root), layer_file_name("blocks.3.proj.weight"))
    os.utime(path)  # same bytes, new times: read again once, then trusted
    done = run_python(COUNTING_START, *args, forked_from=TORCH)
    assert done.stdout.split() == [str(LAYERS), "0", "1"], done.stderr[-2000:]
    done = run_python(COUNTING_START, *args, forked_from=TORCH)
    assert done.stdout.split() == [str(LAYERS), "0", "0"], done.stderr[-2000:]
