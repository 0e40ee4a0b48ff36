"""A provisional build left resumable by a builder that died: resumed while a start may
still build under its provisional key, removed by the first start after none can.

A start builds under a provisional key only while its base's digests are not known. A
failed folded build keeps its sealed layers, marked resumable, for the next such start;
once the digest memo knows every shard it was built from (the next start hashed them),
no start will take it up again, and the next start's dead-writer sweep removes it.
"""

from __future__ import annotations

import os
import shutil

from hostmem.vault import Vault
from hostmem.vault.provisional import mark_provisional
from tests.faults.test_folded_hash import fresh_start
from tests.faults.world import assert_same, combination_folder, make_world, reference


def test_a_resumable_build_nobody_can_resume_is_removed_by_the_next_start(tmp_path):
    world = make_world(tmp_path / "world")
    root = str(tmp_path / "root")
    fresh_start(world.base, world.adapter, root)
    cache = os.path.dirname(combination_folder(root))
    os.unlink(os.path.join(cache, "content_hashes.json"))  # the base's digest not known to any start
    left = os.path.join(cache, "a" * 64)
    shutil.copytree(combination_folder(root), left)
    mark_provisional(left, "a" * 64, [world.base], resumable=True)  # a folded build that failed; its builder died
    Vault(root)
    assert os.path.isdir(left), "removed while a start on the same base could still resume it"
    served, _ = fresh_start(world.base, world.adapter, root)  # hashes the base: its digest is memoised
    assert_same(served, reference(world.base, world.adapter))
    Vault(root)  # the next start's sweep
    assert not os.path.lexists(left)
