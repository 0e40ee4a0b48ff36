"""An adapter replaced or written while a merge uses it never has its merge stored under
the other version's key.

A merge reads the adapter when it plans, keys the combination by the file's digest, and
reads the values again while it builds. Each step is driven here through the public
doors a server's switch uses (``plan_targets``, ``open_combination``, ``merge_layers``),
with the file changed between two of them as a download renamed over it or ``cp`` into
it would change it: the merge stops with the file named, nothing of the other version
is sealed, and the next merge of the file as it is now is the right one."""

from __future__ import annotations

import os

import pytest
import torch

import lora_cache
from lora_cache.adapters import AdapterError
from lora_cache.layer_loop import merge_layers
from lora_cache.orchestrate import open_combination, plan_targets
from tests.lora_cache.test_adapters import lora_change, mapped_model, write_adapter

LAYERS = 2  # mapped_model has two blocks


def _adapter(path, seed: int) -> str:
    return write_adapter(path, "kohya", {f"blocks.{i}.attn.to_q": lora_change(64, 64, 4, seed * 10 + i)
                                         for i in range(LAYERS)})


def _other_version(tmp_path, path: str) -> bytes:
    """The bytes of another training of the same adapter (same keys, shapes and length)."""
    other = _adapter(tmp_path / "other.safetensors", 2)
    with open(other, "rb") as handle:
        data = handle.read()
    assert len(data) == os.path.getsize(path)
    return data


def _write_in_place(path: str, data: bytes) -> None:
    with open(path, "r+b") as handle:  # same inode, same length: cp over it, rsync --inplace
        handle.write(data)


def _reference(tmp_path, adapter: str) -> dict[str, torch.Tensor]:
    os.makedirs(tmp_path / "ref", exist_ok=True)
    model = mapped_model(tmp_path / "ref")
    lora_cache.merge(model, [adapter], cache_root=None, enabled=False, progress=False)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_an_adapter_renamed_over_between_its_read_and_its_key_is_refused(tmp_path):
    model, root = mapped_model(tmp_path), str(tmp_path / "cache")
    adapter = _adapter(tmp_path / "a.safetensors", 1)
    planned = plan_targets(model, [adapter])
    newer = tmp_path / "download.part"
    newer.write_bytes(_other_version(tmp_path, adapter))
    os.replace(newer, adapter)  # a downloader's last step
    with pytest.raises(AdapterError, match=r"a.safetensors: changed since this merge read it \(it was replaced\)"):
        open_combination(planned, [lora_cache.Adapter(adapter)], root)


@pytest.mark.parametrize("read_again", [False, True], ids=["same-read", "read-again"])
def test_an_adapter_written_after_its_key_seals_no_layer_of_the_other_version(tmp_path, read_again):
    """Written in place once the key is made: the build reads the new bytes (through the
    first read's mapping, or a second read as a start makes), which must never be sealed
    under the key of the old ones."""
    model, root = mapped_model(tmp_path), str(tmp_path / "cache")
    adapter = _adapter(tmp_path / "a.safetensors", 1)
    with open(adapter, "rb") as handle:
        original = handle.read()
    expected = _reference(tmp_path, adapter)
    planned = plan_targets(model, [adapter])
    opened = open_combination(planned, [lora_cache.Adapter(adapter)], root)
    _write_in_place(adapter, _other_version(tmp_path, adapter))
    targets = plan_targets(model, [adapter])[0] if read_again else planned[0]
    with opened.session as session:
        with pytest.raises(AdapterError, match="a.safetensors: changed since this merge read it"):
            merge_layers(targets, session, fallback=False, progress=False)
    assert all(torch.equal(p, expected_base) for p, expected_base in
               zip(model.parameters(), mapped_model(tmp_path / "base").parameters()))  # nothing installed

    _write_in_place(adapter, original)  # the version the key names, back: a layer of the other's would be a hit
    lora_cache.merge(model, [adapter], cache_root=root, progress=False)
    for name, weight in model.named_parameters():
        assert torch.equal(weight, expected[name]), name


def test_a_pickled_adapter_touched_or_replaced_between_two_merges_merges_again(tmp_path):
    """torch.save's files (peft's adapter_model.bin) are read by path: the check is that the
    file stayed one file while it was read, not that it is the file an earlier merge keyed."""
    from safetensors.torch import load_file

    root = str(tmp_path / "cache")
    pickled = str(tmp_path / "a.bin")
    torch.save(load_file(_adapter(tmp_path / "a.safetensors", 1)), pickled)
    lora_cache.merge(mapped_model(tmp_path / "m1"), [pickled], cache_root=root, progress=False)
    os.utime(pickled, None)  # touched: the same bytes, another mtime
    second = mapped_model(tmp_path / "m2")
    lora_cache.merge(second, [pickled], cache_root=root, progress=False)
    torch.save(load_file(_adapter(tmp_path / "b.safetensors", 2)), pickled)  # a new version
    third = mapped_model(tmp_path / "m3")
    lora_cache.merge(third, [pickled], cache_root=root, progress=False)
    expected = _reference(tmp_path, str(tmp_path / "b.safetensors"))
    for name, weight in third.named_parameters():
        assert torch.equal(weight, expected[name]), name
