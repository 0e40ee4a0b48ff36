"""A first start on a new base (its hash folded into the build) is sealed behind the start
too: the start waits for the hash only, so it reports the real key, and the seal and the
re-key to that key go on in the seal's thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import torch

import lora_cache
from hostmem.vault import fold, wait_sealed
from hostmem.vault.content_hash import CONTENT_HASH_MEMO
from hostmem.vault.manifest import MANIFEST_NAME
from hostmem.vault.provisional import MARKER_NAME
from tests.lora_cache.test_seal_behind import REPO, _adapter, _folder, _in_place, _mapped_paths, _model
from tests.lora_cache.test_write_way import _no_way_in_this_process, _remember  # noqa: F401


def _combinations(root) -> list[str]:
    cache = os.path.join(root, "lora_merge_cache")
    return sorted(n for n in os.listdir(cache) if len(n) == 64 and os.path.isdir(os.path.join(cache, n)))


def _first_start(root, tmp_path, way: str = "buffered"):
    """A start on a base no start has hashed: the root remembers ``way`` as its faster way
    to write, and nothing else."""
    _remember(root, way)
    CONTENT_HASH_MEMO.clear()
    model, adapter = _model(tmp_path), _adapter(tmp_path)
    return model, adapter, lora_cache.merge(model, [adapter], cache_root=root, progress=False)


def test_a_folded_first_start_serves_the_merge_at_once_and_names_it_by_the_key_it_reported(tmp_path):
    root = tmp_path / "cache"
    model, adapter, stats = _first_start(root, tmp_path)
    assert stats.built == 4 and stats.sealed_behind
    expected = _in_place(tmp_path, adapter)
    assert all(torch.equal(expected[n], p) for n, p in model.named_parameters())  # before the seal is done
    assert wait_sealed(timeout=60)
    assert _combinations(root) == [stats.cache_key]  # the provisional folder took the key the start reported
    folder = _folder(root, stats.cache_key)
    with open(os.path.join(folder, MANIFEST_NAME)) as handle:
        manifest = json.load(handle)
    assert manifest["complete"] and manifest["key"] == stats.cache_key
    assert not os.path.exists(os.path.join(folder, MARKER_NAME))
    assert {os.path.join(folder, layer["file"]) for layer in manifest["layers"]} <= _mapped_paths()
    assert all(torch.equal(expected[n], p) for n, p in model.named_parameters())


def test_a_folded_first_start_written_around_the_page_cache_is_named_by_its_key_before_it_returns(tmp_path):
    root = tmp_path / "cache"
    model, adapter, stats = _first_start(root, tmp_path, "direct")
    assert stats.built == 4 and not stats.sealed_behind
    assert _combinations(root) == [stats.cache_key]
    with open(os.path.join(_folder(root, stats.cache_key), MANIFEST_NAME)) as handle:
        assert json.load(handle)["complete"]
    assert stats.cache_root == str(root)


def test_a_second_start_right_after_a_folded_one_waits_for_its_seal_and_hits(tmp_path, capfd, monkeypatch):
    root, rekey = tmp_path / "cache", fold.rekey
    monkeypatch.setattr(fold, "rekey", lambda *args: (time.sleep(0.5), rekey(*args))[1])  # a seal still under way
    _, adapter, first = _first_start(root, tmp_path)
    assert first.sealed_behind
    capfd.readouterr()
    again = _model(tmp_path)
    second = lora_cache.merge(again, [adapter], cache_root=root, progress=False)  # the seal still under way
    assert (second.hit, second.built, second.cache_key) == (4, 0, first.cache_key)
    said = capfd.readouterr().err
    assert "another start" not in said and "in use by another process" not in said, said  # its own seal, waited for
    expected = _in_place(tmp_path, adapter)
    assert all(torch.equal(expected[n], p) for n, p in again.named_parameters())


_CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    import pathlib
    from tests.lora_cache.test_fold_behind import _first_start
    tmp = pathlib.Path({tmp!r})
    _, _, stats = _first_start(tmp / "cache", tmp)
    print(stats.cache_key, stats.sealed_behind, flush=True)
""")


def test_a_process_that_ends_right_after_a_folded_start_leaves_it_sealed_under_its_real_key(tmp_path, capfd):
    code = _CHILD.format(repo=REPO, tmp=str(tmp_path))
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    key, behind = child.stdout.split()
    assert behind == "True" and "Traceback" not in child.stderr
    assert _combinations(tmp_path / "cache") == [key]
    CONTENT_HASH_MEMO.clear()  # this process knows nothing of the base: the root's memo says it
    stats = lora_cache.merge(_model(tmp_path), [_adapter(tmp_path)], cache_root=tmp_path / "cache", progress=False)
    assert (stats.hit, stats.cache_key) == (4, key)
