"""Layers written through the page cache: served from their files at once, fsynced and named
at the close, which may go on in a thread (``close(behind=True)``); the build leaves at
most a share of the page cache's room unwritten.

Each page's state is the kernel's own: ``/proc/self/pagemap`` gives the frame a page of
the served mapping lies in, ``/proc/kpageflags`` whether that frame is dirty (not yet on
disk) or under writeback.
"""

from __future__ import annotations

import json
import os
import struct
import time

import pytest
import torch

from hostmem.vault import Vault, wait_sealed
from hostmem.vault import behind
from hostmem.vault.durable import TMP_PREFIX
from hostmem.vault.manifest import MANIFEST_NAME
from tests.hostmem.vault.test_vault import expected_of, folder_of, key_for

_KPF_DIRTY, _KPF_WRITEBACK = 1 << 4, 1 << 8


def _layers(count: int = 4) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    return {f"blocks.{i}.weight": torch.randn(512, 1024, generator=gen).to(torch.bfloat16) for i in range(count)}


def _unwritten_pages(view: torch.Tensor) -> int:
    """Pages of ``view``'s mapping that are dirty or under writeback (each touched first, so
    that it is mapped in)."""
    float(view.float().sum())
    start, end = view.data_ptr() // 4096, -(-(view.data_ptr() + view.numel() * view.element_size()) // 4096)
    with open("/proc/self/pagemap", "rb") as pagemap, open("/proc/kpageflags", "rb") as flags:
        pagemap.seek(start * 8)
        entries = struct.unpack(f"{end - start}Q", pagemap.read((end - start) * 8))
        unwritten = 0
        for entry in entries:
            frame = entry & ((1 << 55) - 1)
            if not entry >> 63 or frame == 0:
                pytest.skip("the page frames of this process's mappings cannot be read here (not root)")
            flags.seek(frame * 8)
            (bits,) = struct.unpack("Q", flags.read(8))
            unwritten += bool(bits & (_KPF_DIRTY | _KPF_WRITEBACK))
    return unwritten


@pytest.fixture
def page_flags():
    if not os.access("/proc/kpageflags", os.R_OK):
        pytest.skip("/proc/kpageflags cannot be read here")


def _built(tmp_path, tensors, behind: bool = True):
    """A build through the page cache; ``behind``: its session will seal behind the start."""
    vault, key = Vault(tmp_path / "root"), key_for("behind")
    session = vault.open(key, expected_of(tensors))
    session.write_layers("buffered")
    session.seal_behind = behind
    views = [session.put(name, tensor) for name, tensor in tensors.items()]
    return vault, key, session, views


def test_a_layer_through_the_page_cache_is_served_unwritten_and_the_close_makes_it_durable(tmp_path, page_flags,
                                                                                           monkeypatch):
    monkeypatch.setattr(behind, "DIRTY_SHARE", 1.0)  # nothing started before the close
    tensors = _layers()
    vault, key, session, views = _built(tmp_path, tensors)
    assert all(torch.equal(v, t) for v, t in zip(views, tensors.values()))
    assert all(_unwritten_pages(v) > 0 for v in views)  # served from the page cache, not yet on disk
    folder = folder_of(vault, key)
    assert len([n for n in os.listdir(folder) if n.startswith(TMP_PREFIX)]) == len(tensors)  # and not named
    session.close()
    assert [_unwritten_pages(v) for v in views] == [0] * len(views)  # fsynced at the close
    assert not [n for n in os.listdir(folder) if n.startswith(TMP_PREFIX)]
    with vault.open(key, expected_of(tensors)) as again:
        assert again.complete and all(torch.equal(again.get(n, tuple(t.shape), t.dtype), t) for n, t in tensors.items())


@pytest.mark.parametrize("share, behind_start", [(0.0, True), (1.0, False)],
                         ids=["past its share of the page cache", "sealed in its start"])
def test_a_build_starts_the_disk_on_its_layers_past_its_share_or_where_its_close_waits(tmp_path, page_flags,
                                                                                      monkeypatch, share,
                                                                                      behind_start):
    monkeypatch.setattr(behind, "DIRTY_SHARE", share)
    vault, key, session, views = _built(tmp_path, _layers(), behind=behind_start)
    try:
        deadline = time.monotonic() + 10
        while (left := [_unwritten_pages(v) for v in views]) != [0] * len(views) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert left == [0] * len(views)  # written out before the close (no fsync has run yet)
        assert [n for n in os.listdir(folder_of(vault, key)) if n.startswith(TMP_PREFIX)]
    finally:
        session.close()


def test_a_close_behind_returns_and_the_seal_is_done_by_a_thread_holding_the_key(tmp_path):
    tensors = _layers()
    vault, key, session, views = _built(tmp_path, tensors)
    session.close(behind=True)
    assert session.stats["sealed_behind"]
    assert wait_sealed(folder_of(vault, key), timeout=60)
    with open(os.path.join(folder_of(vault, key), MANIFEST_NAME)) as handle:
        manifest = json.load(handle)
    assert manifest["complete"] and len(manifest["layers"]) == len(tensors)
    assert not os.path.exists(os.path.join(vault.cache, key.hex + ".lock"))  # let go once sealed
    assert all(torch.equal(v, t) for v, t in zip(views, tensors.values()))


def test_a_close_behind_with_nothing_in_the_page_cache_seals_at_once(tmp_path):
    vault, key, tensors = Vault(tmp_path / "root"), key_for("direct"), _layers()
    session = vault.open(key, expected_of(tensors))
    for name, tensor in tensors.items():  # written around the page cache: durable at each put
        session.put(name, tensor)
    session.close(behind=True)
    assert not session.stats["sealed_behind"]
    assert os.path.exists(os.path.join(folder_of(vault, key), MANIFEST_NAME))
