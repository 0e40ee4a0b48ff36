"""Share sessions: disjoint layers of one combination written at once, adopted after."""

from __future__ import annotations

import os

import pytest
import torch

from hostmem.vault import Vault, VaultError
from hostmem.vault.combinations import lock_path
from hostmem.vault.locks import KeyLock
from hostmem.vault import verification
from hostmem.vault.shares import open_share, share_lock_path, vouch_for
from tests.hostmem.vault.test_vault import expected_of, key_for, layers


def _halves(tensors: dict) -> tuple[dict, dict]:
    names = sorted(tensors)
    return {n: tensors[n] for n in names[::2]}, {n: tensors[n] for n in names[1::2]}


def _forget_this_process_verified() -> None:
    """Open next as another rank would: without what this process checksummed as it wrote."""
    verification._PROCESS.clear()


def _write_share(vault, key, share: dict, index: int, count: int) -> list[dict]:
    with open_share(vault, key, expected_of(share), index, count) as session:
        for name, tensor in share.items():
            assert session.put(name, tensor) is not None, session.last_error
        return session.written()


@pytest.mark.parametrize("vouched", [True, False])
def test_two_shares_open_at_once_then_one_plain_session_adopts_both(tmp_path, vouched):
    vault, key, tensors = Vault(tmp_path / "root"), key_for("shares"), layers(count=4)
    first, second = _halves(tensors)
    a = open_share(vault, key, expected_of(first), 0, 2)
    try:
        plain = KeyLock(lock_path(vault.cache, key.hex))
        assert not plain.acquire(blocking=False)  # a plain session waits while a share is open
        for name, tensor in first.items():
            assert a.put(name, tensor) is not None
        written = a.written()
    finally:
        a.close()
    written += _write_share(vault, key, second, 1, 2)
    assert sorted(w["entry"]["name"] for w in written) == sorted(tensors)
    assert not os.path.exists(os.path.join(vault.cache, key.hex, "manifest.json"))  # shares never seal
    _forget_this_process_verified()
    if vouched:
        assert vouch_for(vault, key.hex, written) == len(tensors)
    with vault.open(key, expected_of(tensors)) as session:
        assert session.complete and session.stats["layers_resumed"] == len(tensors)
        assert session.stats["layers_verified"] == (0 if vouched else len(tensors))  # vouched: not read again
        for name, tensor in tensors.items():
            assert torch.equal(session.get(name, tuple(tensor.shape), tensor.dtype), tensor)
    assert os.path.exists(os.path.join(vault.cache, key.hex, "manifest.json"))
    assert not os.path.exists(lock_path(vault.cache, key.hex))


def test_a_share_that_stopped_half_way_resumes_and_its_sealed_layer_is_not_rebuilt(tmp_path):
    vault, key, tensors = Vault(tmp_path / "root"), key_for("resume"), layers(count=2)
    done, expected = sorted(tensors)[0], expected_of(tensors)
    with open_share(vault, key, expected, 0, 1) as session:
        session.put(done, tensors[done])  # then the rank died: no manifest, the layer file stays
    with open_share(vault, key, expected, 0, 1) as session:
        assert set(session.layers) == {done} and not session.complete
        assert session.written() == []  # found sealed, not written by this session
    assert not os.path.exists(share_lock_path(vault.cache, key.hex, 0, 1))


def test_a_changed_file_is_not_vouched_for_and_is_verified_on_adoption(tmp_path):
    vault, key, tensors = Vault(tmp_path / "root"), key_for("changed"), layers(count=2)
    written = _write_share(vault, key, tensors, 0, 1)
    path = os.path.join(vault.cache, key.hex, written[0]["entry"]["file"])
    os.utime(path, ns=(1, 1))  # a new stamp: whatever the writer saw no longer stands
    assert vouch_for(vault, key.hex, written) == 1
    _forget_this_process_verified()
    with vault.open(key, expected_of(tensors)) as session:
        assert session.complete and session.stats["layers_verified"] == 1


def test_a_file_changed_before_the_share_closes_is_not_vouched_for(tmp_path):
    """A share vouches for each layer at the stamp it was written and checksummed at, not at
    the one it has when the share closes: bytes changed in between are read on adoption,
    found wrong, and rebuilt, never served."""
    vault, key, tensors = Vault(tmp_path / "root"), key_for("before-close"), layers(count=2)
    name = sorted(tensors)[0]
    with open_share(vault, key, expected_of(tensors), 0, 1) as session:
        for n, tensor in tensors.items():
            assert session.put(n, tensor) is not None
        path = os.path.join(vault.cache, key.hex, session.layers[name].file)
        with open(path, "r+b") as handle:  # a byte of the data changed behind the writer
            handle.seek(-1, os.SEEK_END)
            last = handle.read(1)
            handle.seek(-1, os.SEEK_END)
            handle.write(bytes([last[0] ^ 0xFF]))
        written = session.written()
    assert vouch_for(vault, key.hex, written) == 1  # the other layer only
    _forget_this_process_verified()
    with vault.open(key, expected_of(tensors)) as session:
        assert session.stats["layers_failed_check"] == [name]
        assert session.get(name, tuple(tensors[name].shape), tensors[name].dtype) is None


def test_a_share_index_out_of_range_is_refused_and_leaves_the_key_free(tmp_path):
    vault, key = Vault(tmp_path / "root"), key_for("bad")
    with pytest.raises(VaultError, match="share 2 of 2: the index must be in 0..1"):
        open_share(vault, key, {}, 2, 2)
    with vault.open(key, {}) as session:  # nothing claimed or locked by the refusal
        assert session.complete
