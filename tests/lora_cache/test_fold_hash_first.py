"""The hash of a new base starts before the start measures its layers' rounding loss (that
measure waits on scattered reads more than on a core, and the hasher reads its first
window meanwhile), and a start that fails before its build stops it there."""

from __future__ import annotations

import threading

import pytest

import lora_cache
from hostmem.errors import InputError
from hostmem.vault import wait_sealed
from hostmem.vault.content_hash import CONTENT_HASH_MEMO
from lora_cache.placement.rounding_memo import RoundingSplit
from tests.lora_cache.test_seal_behind import _adapter, _in_place, _model
from tests.lora_cache.test_write_way import _no_way_in_this_process, _remember  # noqa: F401

HASHER = "hostmem-fold-hash"


def _hashing() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == HASHER and t.is_alive()]


def test_the_hasher_runs_while_the_rounding_is_measured_and_the_build_is_the_in_place_merge(tmp_path, monkeypatch):
    root, seen = tmp_path / "cache", []
    _remember(root, "buffered")
    CONTENT_HASH_MEMO.clear()
    measure = RoundingSplit.kept_apart

    def kept_apart(self, vaults, key_hex, inputs):
        seen.append((key_hex, len(_hashing())))
        return measure(self, vaults, key_hex, inputs)

    monkeypatch.setattr(RoundingSplit, "kept_apart", kept_apart)
    model, adapter = _model(tmp_path), _adapter(tmp_path)
    stats = lora_cache.merge(model, [adapter], cache_root=root, progress=False)
    assert stats.built == 4 and wait_sealed(timeout=60)
    assert seen == [(None, 1)]  # no key yet, and the base already being hashed
    expected = _in_place(tmp_path, adapter)
    assert all(p.equal(expected[n]) for n, p in model.named_parameters())
    assert CONTENT_HASH_MEMO.computed >= 1


def test_a_start_that_fails_before_its_build_stops_the_hasher_and_leaves_the_model_as_it_was(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    _remember(root, "buffered")
    CONTENT_HASH_MEMO.clear()

    def kept_apart(self, vaults, key_hex, inputs):
        raise InputError("the rounding measure failed")

    monkeypatch.setattr(RoundingSplit, "kept_apart", kept_apart)
    model, adapter = _model(tmp_path), _adapter(tmp_path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(InputError, match="the rounding measure failed"):
        lora_cache.merge(model, [adapter], cache_root=root, progress=False)
    assert _hashing() == []
    assert all(p.equal(before[n]) for n, p in model.named_parameters())
