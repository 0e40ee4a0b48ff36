"""The rounding split is measured once per combination and recorded: a hit reads it back."""

from __future__ import annotations

import gc
import json
import os

import pytest
import torch

import lora_cache
from lora_cache.placement.rounding_memo import MEASURE
from planners.cli import main
from tests.lora_cache.test_rounding import (BF16_EPS, DIM, adapter, base_model, fp32_reference, relative_error,
                                            write_config)

LOSSY = "kept at run time"


def _start(folder, path, roots):
    model = base_model(folder)
    with pytest.warns(UserWarning, match=LOSSY):
        stats = lora_cache.merge(model, [path], cache_root=roots)
    return model, stats


def _record(root, key: str) -> str:
    return os.path.join(root, "lora_merge_cache", "rounding", f"{key}.json")


def test_a_hit_decides_from_the_record_and_serves_what_the_measure_served(tmp_path):
    path, changes = adapter(tmp_path)
    root = tmp_path / "cache"
    first, built = _start(tmp_path, path, root)
    record = json.loads(open(_record(root, built.cache_key)).read())
    assert record["measure"] == MEASURE and record["key"] == built.cache_key and record["measured"] == 2
    assert set(record["lost"]) == {"turbo.weight"} and record["digest"].startswith("blake3:")
    assert built.rounding["recorded"] is False
    model, stats = _start(tmp_path, path, root)
    assert stats.rounding["recorded"] is True and stats.rounding["lost"] == built.rounding["lost"]
    assert (stats.hit, stats.built, stats.at_runtime, stats.bytes_written) == (1, 0, 1, 0)
    x = torch.ones(8, DIM, dtype=torch.bfloat16)
    assert torch.equal(model.turbo(x), first.turbo(x)) and torch.equal(model.plain.weight, first.plain.weight)
    assert relative_error(model.turbo(x), fp32_reference(first.turbo.weight, changes["turbo"], x)) < BF16_EPS


@pytest.mark.parametrize("damage", ["not json", "other measure", "other key", "a share not a number", "a link"])
def test_a_record_that_is_not_this_combinations_is_measured_again_and_rewritten(tmp_path, damage):
    path, _ = adapter(tmp_path)
    root = tmp_path / "cache"
    _, built = _start(tmp_path, path, root)
    file = _record(root, built.cache_key)
    record = json.loads(open(file).read())
    os.unlink(file)
    if damage == "not json":
        open(file, "w").write("{\"format\": ")
    elif damage == "a link":
        elsewhere = tmp_path / "elsewhere.json"
        elsewhere.write_text(json.dumps({**record, "lost": {}}))
        os.symlink(elsewhere, file)
    else:
        changed = {"other measure": {"measure": "share-lost>0.5@1x1-v0"}, "other key": {"key": "0" * 64},
                   "a share not a number": {"lost": {"turbo.weight": "all"}}}[damage]
        open(file, "w").write(json.dumps({**record, **changed}))
    _, stats = _start(tmp_path, path, root)
    assert stats.rounding["recorded"] is False and stats.rounding["lost"] == built.rounding["lost"]
    assert (stats.hit, stats.at_runtime) == (1, 1)
    assert not os.path.islink(file) and json.loads(open(file).read()) == record  # written anew


def test_a_switch_decides_from_the_record_as_a_merge_of_the_same_combination_does(tmp_path):
    """A record made elsewhere (another CPU's measure, an image) that merges a layer this
    machine's measure would keep at run time: a merge follows the record (and builds that
    layer), and so does a switch to the same combination, serving the same weights."""
    path, _ = adapter(tmp_path)
    root = tmp_path / "cache"
    _, built = _start(tmp_path, path, root)
    file = _record(root, built.cache_key)
    record = json.loads(open(file).read())
    open(file, "w").write(json.dumps({**record, "lost": {}}))  # nothing lost: every layer merged
    merged = base_model(tmp_path)
    stats = lora_cache.merge(merged, [path], cache_root=root)
    assert stats.rounding["recorded"] is True and (stats.hit, stats.built, stats.at_runtime) == (1, 1, 0)
    switched = base_model(tmp_path)
    assert lora_cache.set_adapters(switched, [(path, 1.0)], root).mode == "cached"
    for name in ("turbo", "plain"):
        assert torch.equal(switched[name].weight, merged[name].weight), name


def test_another_users_record_is_not_read(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")
    path, _ = adapter(tmp_path)
    root = tmp_path / "cache"
    _, built = _start(tmp_path, path, root)
    os.chown(_record(root, built.cache_key), 65534, 65534)  # nobody's, in our folder
    _, stats = _start(tmp_path, path, root)
    assert stats.rounding["recorded"] is False and (stats.hit, stats.at_runtime) == (1, 1)


def test_an_image_built_with_hostmem_lora_merge_is_served_whole_from_its_read_only_root(tmp_path, read_only_copy):
    """The image's record gives the split it was built with: every stored layer a hit, the
    lossy one at run time, nothing written into the writable root."""
    base_model(tmp_path)  # writes base.safetensors
    path, changes = adapter(tmp_path)
    image = tmp_path / "image"
    config = write_config(tmp_path, path, image)
    assert main(["lora", "merge", str(config)]) == 0  # the lossy layer said in the report's own line
    baked = read_only_copy(str(image))
    local = tmp_path / "local"
    model, stats = _start(tmp_path, path, [baked, str(local)])
    assert stats.rounding["recorded"] is True and stats.cache_root == baked
    assert (stats.hit, stats.built, stats.at_runtime, stats.bytes_written) == (1, 0, 1, 0)
    combos = os.path.join(local, "lora_merge_cache")
    assert not os.path.exists(os.path.join(combos, stats.cache_key)), "rebuilt into the writable root"
    x = torch.ones(8, DIM, dtype=torch.bfloat16)
    base = model.turbo.weight  # the mapped base: its terms are added at run time
    assert relative_error(model.turbo(x), fp32_reference(base, changes["turbo"], x)) < BF16_EPS


def test_ls_counts_the_record_and_prune_removes_it_with_its_last_combination(tmp_path, capsys):
    from hostmem.vault.records import FRESH_SECONDS

    path, _ = adapter(tmp_path)
    root = str(tmp_path / "cache")
    model, built = _start(tmp_path, path, root)
    file = _record(root, built.cache_key)
    capsys.readouterr()
    assert main(["cache", "ls", "--root", root]) == 0
    # the rounding record, and the adapter's meaning (lora_cache.key.combination), kept with the conversions
    assert "records: 2 (1 conversion, 1 rounding)" in (out := capsys.readouterr().out), out
    aged = os.stat(file).st_mtime - FRESH_SECONDS - 60
    os.utime(file, (aged, aged))
    assert main(["cache", "prune", "--root", root]) == 0 and os.path.exists(file)  # its combination is still there
    del model  # its weights are views of the combination: it stays in use while they live
    gc.collect()
    assert main(["cache", "rm", "--root", root, built.cache_key[:12]]) == 0
    capsys.readouterr()
    assert main(["cache", "prune", "--root", root]) == 0
    assert "removed 1 record(s)" in capsys.readouterr().out and not os.path.exists(file)  # the meaning's is fresh
