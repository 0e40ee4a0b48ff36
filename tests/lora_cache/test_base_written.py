"""A base checkpoint written while a merge builds from it never has its merge stored under
the other version's key.

The key names the base by the content digest of its shards (hashed first, or beside the
build when the base is new: :mod:`hostmem.vault.fold`), and the build reads the base's
weights through their mapping, which sees a write into the file (``cp`` over it, ``rsync
--inplace``). Driven through the doors a server's switch uses (``plan_targets``,
``open_combination``, ``merge_layers``), with the shard written between the key and the
build: the merge stops naming the shard, nothing of the other version is sealed, and
the next merge of the base as the key names it is the right one."""

from __future__ import annotations

import os

import pytest
import torch

import lora_cache
from hostmem.errors import HostmemError
from hostmem.vault.content_hash import CONTENT_HASH_MEMO
from lora_cache.layer_loop import merge_layers
from lora_cache.orchestrate import open_combination, plan_targets
from tests.lora_cache.test_adapters import lora_change, mapped_model, write_adapter


def _reference(folder, adapter: str) -> dict[str, torch.Tensor]:
    os.makedirs(folder, exist_ok=True)
    model = mapped_model(folder)
    lora_cache.merge(model, [adapter], cache_root=None, enabled=False, progress=False)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("times", ["as written", "mtime put back"])
@pytest.mark.parametrize("hashed", ["first", "beside the build"])
def test_a_base_written_after_its_key_seals_no_layer_of_the_other_version(tmp_path, hashed, times):
    """``times``: the writer (another user who owns the file, say) puts its mtime back, as
    ``touch -r`` or ``os.utime`` can; only its ctime says it was written."""
    model, root = mapped_model(tmp_path), str(tmp_path / "cache")
    base = str(tmp_path / "base.safetensors")
    adapter = write_adapter(tmp_path / "a.safetensors", "kohya",
                            {f"blocks.{i}.attn.to_q": lora_change(64, 64, 4, i) for i in range(2)})
    with open(base, "rb") as handle:
        original = handle.read()
    expected = _reference(tmp_path / "ref", adapter)
    other = mapped_model(tmp_path / "other", seed=1)  # another training: the same names, shapes and length
    with open(tmp_path / "other" / "base.safetensors", "rb") as handle:
        newer = handle.read()
    assert len(newer) == len(original) and newer != original
    del other
    if hashed == "first":
        CONTENT_HASH_MEMO.digest(base)  # memoised: the key is known before the build
    else:
        CONTENT_HASH_MEMO.clear()  # a new base: hashed beside the build, under a provisional key

    planned = plan_targets(model, [adapter])
    opened = open_combination(planned, [lora_cache.Adapter(adapter)], root)
    before = os.stat(base)
    with open(base, "r+b") as handle:  # same inode, same length: cp over it
        handle.write(newer)
    if times == "mtime put back":
        os.utime(base, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(HostmemError, match=r"base.safetensors: changed since this merge keyed it \((it was written|its inode changed: written)"):
        with opened.session as session:
            merge_layers(planned[0], session, fallback=False, progress=False)

    with open(base, "r+b") as handle:  # the version the key names, back: a layer of the other's would be a hit
        handle.write(original)
    fresh = mapped_model(tmp_path)  # writes the original's bytes again, and maps them
    lora_cache.merge(fresh, [adapter], cache_root=root, progress=False)
    for name, weight in fresh.named_parameters():
        assert torch.equal(weight, expected[name]), name


def test_a_base_renamed_over_or_given_another_mode_during_a_build_stops_it_saying_which(tmp_path):
    """Both leave the bytes alone, or may not: whoever can do either can write the file and
    put its mtime back, which only its ctime shows. The build stops, and says what it saw."""
    model, root = mapped_model(tmp_path), str(tmp_path / "cache")
    base = str(tmp_path / "base.safetensors")
    adapter = write_adapter(tmp_path / "a.safetensors", "kohya",
                            {f"blocks.{i}.attn.to_q": lora_change(64, 64, 4, i) for i in range(2)})
    CONTENT_HASH_MEMO.digest(base)
    planned = plan_targets(model, [adapter])
    from lora_cache.layer_loop import _LayerLoop

    real = _LayerLoop.stream
    for change, said in ((lambda: os.chmod(base, 0o640), "its inode changed"),
                         (lambda: _landed_again(base), "it was removed, or another file renamed over it")):
        opened = open_combination(planned, [lora_cache.Adapter(adapter)], root)

        def changed_then(self, *args, change=change, **kwargs):
            change()
            return real(self, *args, **kwargs)

        _LayerLoop.stream = changed_then
        try:
            with pytest.raises(HostmemError, match=said):
                with opened.session as session:
                    merge_layers(planned[0], session, fallback=False, progress=False)
        finally:
            _LayerLoop.stream = real
        model, planned = mapped_model(tmp_path), None  # the base as it is now, mapped again
        CONTENT_HASH_MEMO.digest(base)
        planned = plan_targets(model, [adapter])


def _landed_again(path: str) -> None:
    """The same bytes landed again at ``path``, as a downloader lands a file: a new inode renamed over it."""
    with open(path, "rb") as src, open(path + ".part", "wb") as dst:
        dst.write(src.read())
    os.replace(path + ".part", path)
