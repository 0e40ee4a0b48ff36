"""The shared build on a base not hashed yet: the ranks hash it beside their shares, under a
provisional key, and the combination is re-keyed to its real key once every rank's
digests are in (gloo on the CPU, spawned processes, as tests/lora_cache/test_shared_build.py)."""

from __future__ import annotations

import json
import os
import shutil

import lora_cache
from hostmem.vault.content_hash import CONTENT_HASH_MEMO, load_memo_file
from hostmem.vault.provisional import MARKER_NAME
from hostmem.vault.store import MEMO_NAME
from lora_cache.placement.layers import checkpoint_module
from lora_cache.ranks.fold import fold_pays
from tests.lora_cache.test_shared_build import SHAPES, _rank_main, inputs, spawn_ranks  # noqa: F401 (a fixture)

FOLDED = "the base hashed beside them"


def _combinations(root) -> list[str]:
    cache = os.path.join(root, "lora_merge_cache")
    return sorted(n for n in os.listdir(cache) if os.path.isdir(os.path.join(cache, n)) and len(n) == 64)


def test_the_ranks_fold_only_where_hashing_first_leaves_cores_idle():
    assert fold_pays(files=1, ranks=2, cores=2)  # one rank hashes the one file: a core idles
    assert fold_pays(files=4, ranks=8, cores=64)
    assert not fold_pays(files=4, ranks=4, cores=2)  # four hashes at once fill both cores
    assert not fold_pays(files=0, ranks=2, cores=8)  # nothing to hash
    assert not fold_pays(files=3, ranks=1, cores=1)


def test_two_ranks_hash_a_new_base_beside_their_shares_and_rekey_once(inputs, tmp_path, capfd):
    """One base file and two ranks on any machine with two cores: hashing first would leave a
    core idle, so the ranks fold."""
    results = spawn_ranks(_rank_main, 2, inputs, tmp_path, ["build", "hit"])
    built = [r["build"]["built"] for r in results]
    assert sum(built) == len(SHAPES) and all(b > 0 for b in built), built
    assert all(r["build"]["equal"] for r in results), results
    assert all(r["hit"]["hit"] == len(SHAPES) and r["hit"]["built"] == 0 and r["hit"]["equal"] for r in results)
    err = capfd.readouterr().err
    assert FOLDED in err, err
    assert "adopting it" not in err and "waiting for it" not in err, err
    root = tmp_path / "cache"
    (key,) = _combinations(root)  # the provisional folder is gone: one combination, under its real key
    folder = root / "lora_merge_cache" / key
    assert not (folder / MARKER_NAME).exists()
    with open(folder / "manifest.json") as handle:
        assert json.load(handle)["key"] == key
    memo = load_memo_file(str(root / "lora_merge_cache" / MEMO_NAME))
    assert len(memo) == 2, memo  # the base and the adapter: the next start hashes nothing
    # a single process on the same root finds the same key without building
    model = checkpoint_module([inputs["base"]])
    stats = lora_cache.merge(model, [inputs["adapter"]], cache_root=str(root), progress=False)
    assert stats.cache_key == key and stats.hit == len(SHAPES) and stats.built == 0


def test_ranks_whose_base_digests_are_memoised_hash_nothing_and_do_not_fold(inputs, tmp_path, capfd):
    root = tmp_path / "cache"
    CONTENT_HASH_MEMO.clear()  # this process hashed the base for another root: hash it for this one's memo
    model = checkpoint_module([inputs["base"]])
    key = lora_cache.merge(model, [inputs["adapter"]], cache_root=str(root), progress=False).cache_key
    shutil.rmtree(root / "lora_merge_cache" / key)  # the combination goes, the memo of digests stays
    capfd.readouterr()
    results = spawn_ranks(_rank_main, 2, inputs, tmp_path, ["build"])
    assert sum(r["build"]["built"] for r in results) == len(SHAPES)
    assert all(r["build"]["equal"] for r in results), results
    err = capfd.readouterr().err
    assert "ranks built" in err and FOLDED not in err, err
    assert _combinations(root) == [key]
