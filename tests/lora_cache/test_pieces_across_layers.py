"""A session's streamed puts share their piece writer: the last pieces of one layer are on
their way while the next layer's first go out, and the merge's one buffer is reused only
where every layer still writing from it is done with the bytes."""

from __future__ import annotations

import os
import threading
import zlib

import pytest
import torch
from torch import nn

import lora_cache
from hostmem.safetensors.mapping import load_readonly
from hostmem.vault import Vault, cache_key
from hostmem.vault.durable import TMP_PREFIX
from hostmem.vault.handoff import Handoff
from hostmem.vault.piece_writer import PIECE_BYTES, PieceWriter
from hostmem.vault.shares import open_share
from lora_cache.layer_loop import _claim_after
from lora_cache.compute.merge_math import host_buffer
from tests.conftest import write_safetensors
from tests.hostmem.vault.test_piece_writer import _Crc
from tests.lora_cache.test_adapters import lora_change, write_adapter

MiB = 1024 * 1024


def _random_buffer(nbytes: int, seed: int) -> torch.Tensor:
    out = host_buffer(nbytes)
    out.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return out


def _published(nbytes: int) -> Handoff:
    handoff = Handoff(nbytes)
    handoff.publish(nbytes)
    return handoff


def test_two_layers_pieces_share_one_writer_and_each_is_handed_back_whole_when_it_ends(tmp_path):
    sizes = (3 * PIECE_BYTES + 12345, 2 * PIECE_BYTES)  # a tail that is not a whole page, then whole pieces
    buffers = [_random_buffer(n, seed) for seed, n in enumerate(sizes)]
    handoffs = [_published(n) for n in sizes]
    digests = [_Crc(), _Crc()]
    paths = [str(tmp_path / f"layer{i}.bin") for i in range(2)]
    fds = [os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600) for p in paths]
    writer = PieceWriter()
    try:
        pieces = [writer.start(fd, path, memoryview(b.numpy()), 0, b.data_ptr(), h, d)
                  for fd, path, b, h, d in zip(fds, paths, buffers, handoffs, digests)]  # the second before the first ends
        for piece, handoff, nbytes in zip(pieces, handoffs, sizes):
            piece.end()
            assert handoff._released == nbytes
    finally:
        writer.close()
        for fd in fds:
            os.close(fd)
    assert not [t for t in threading.enumerate() if t.name.startswith("hostmem-vault-write")]
    for path, buffer, digest in zip(paths, buffers, digests):
        with open(path, "rb") as handle:
            stored = handle.read()
        assert stored == buffer.numpy().tobytes()
        assert digest.value == zlib.crc32(stored)


@pytest.mark.parametrize("share", [False, True], ids=["plain session", "share of a shared build"])
def test_a_streamed_put_hands_its_buffer_back_whole_once_sealed_and_serves_its_bytes(tmp_path, share):
    key = cache_key({"shards": [{"path": "/models/across.safetensors", "digest": "across"}]}, [], "bfloat16", "pieces")
    first = _random_buffer(6 * MiB, seed=3).view(torch.bfloat16).view(1536, 2048)
    second = _random_buffer(2 * MiB, seed=4).view(torch.bfloat16).view(512, 2048)
    vault = Vault(tmp_path / "root")
    expected = {"a": (tuple(first.shape), first.dtype), "b": (tuple(second.shape), second.dtype)}
    with open_share(vault, key, expected, 0, 1) if share else vault.open(key) as session:
        handoffs = [_published(first.nbytes), _published(second.nbytes)]
        written = [session.put_data("a", first, None, handoffs[0]), session.put_data("b", second, None, handoffs[1])]
        views = [session.seal_put(layer) for layer in written]
        assert [h._released for h in handoffs] == [first.nbytes, second.nbytes]
        for view, buffer in zip(views, (first, second)):  # bytes: random bits hold NaNs
            assert torch.equal(view.view(torch.uint8), buffer.view(torch.uint8))
        assert not [f for f in os.listdir(session.folder) if f.startswith(TMP_PREFIX)]
    assert not [t for t in threading.enumerate() if t.name.startswith("hostmem-vault-write")]  # closed with it


def test_a_block_of_the_reused_buffer_waits_for_every_layer_still_writing_those_bytes():
    older, newer = Handoff(8 * MiB), Handoff(2 * MiB)  # a large layer, then a small one
    newer.release()  # the small layer is written; the large one's tail is still on its way
    older.release(2 * MiB)
    claimed = threading.Event()
    thread = threading.Thread(target=lambda: (_claim_after([older, newer], 6 * MiB), claimed.set()), daemon=True)
    thread.start()
    assert not claimed.wait(0.2), "a block overwrote bytes the large layer had not written yet"
    older.release(6 * MiB)
    assert claimed.wait(10)
    thread.join(10)


def _mixed_model(folder) -> nn.Module:
    """Linear layers of 16, 1, 16, 1 and 16 MiB of bf16 as read-only mappings of a checkpoint:
    each large layer's tail lies where the small one after it does not reach."""
    shapes = [(4096, 2048), (256, 2048), (4096, 2048), (256, 2048), (4096, 2048)]
    gen = torch.Generator().manual_seed(7)
    model = nn.Sequential(*(nn.Linear(cols, rows, bias=False) for rows, cols in shapes))
    tensors = {f"{i}.weight": torch.randn(shape, generator=gen).to(torch.bfloat16) for i, shape in enumerate(shapes)}
    path = write_safetensors(os.path.join(folder, "base.safetensors"), tensors)
    for name, tensor in load_readonly(path).items():
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
    return model


def test_layers_of_mixed_sizes_built_through_one_buffer_equal_the_in_place_merge(tmp_path):
    model = _mixed_model(tmp_path)
    changes = {str(i): lora_change(p.shape[0], p.shape[1], 16, seed=i, alpha=8) for i, p in enumerate(model.parameters())}
    changes = {m: {k: v.to(torch.bfloat16) if k in ("up", "down") else v for k, v in c.items()} for m, c in changes.items()}
    adapter = write_adapter(tmp_path / "mixed.safetensors", "kohya", changes)
    stats = lora_cache.merge(model, [adapter], cache_root=tmp_path / "cache", progress=False)
    assert stats.built == 5 and stats.fallen_back == 0
    cached = {n: p.detach().clone() for n, p in model.named_parameters()}
    lora_cache.unmerge(model)
    lora_cache.merge(model, [adapter], progress=False, enabled=False)
    for name, weight in model.named_parameters():
        assert torch.equal(cached[name], weight), name


def test_a_block_of_the_ring_waits_only_for_the_layers_whose_bytes_it_overwrites():
    from lora_cache.compute.buffers import RING_BYTES, ring_bytes

    below, beside, ahead = Handoff(2 * MiB), Handoff(2 * MiB), Handoff(2 * MiB)  # at 0, 2 and 4 MiB of the ring
    earlier = [(0, below), (2 * MiB, beside), (4 * MiB, ahead)]
    below.release()
    claimed = threading.Event()
    # a layer at 1 MiB: its first 2 MiB cover the tail of the one below and the head of the one beside
    thread = threading.Thread(target=lambda: (_claim_after(earlier, 2 * MiB, at=1 * MiB), claimed.set()), daemon=True)
    thread.start()
    assert not claimed.wait(0.2), "a block overwrote bytes the layer beside had not written yet"
    beside.release(MiB)  # exactly what it covers of that layer; the layer ahead is never waited for
    assert claimed.wait(10)
    thread.join(10)
    assert ring_bytes([2 * MiB] * 100) == RING_BYTES  # small layers: several in the ring
    assert ring_bytes([2 * MiB] * 3) == 6 * MiB  # no more than they add up to
    assert ring_bytes([8 * MiB, MiB]) == 8 * MiB  # large ones: one layer wide, as ever


def test_many_small_layers_built_through_the_ring_equal_the_in_place_merge(tmp_path):
    gen = torch.Generator().manual_seed(11)
    model = nn.Sequential(*(nn.Linear(1024, 256, bias=False) for _ in range(40)))  # 512 KiB each: the ring holds 32
    tensors = {f"{i}.weight": torch.randn(256, 1024, generator=gen).to(torch.bfloat16) for i in range(40)}
    path = write_safetensors(os.path.join(tmp_path, "base.safetensors"), tensors)
    for name, tensor in load_readonly(path).items():
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
    changes = {str(i): lora_change(256, 1024, 8, seed=i, alpha=8) for i in range(40)}
    changes = {m: {k: v.to(torch.bfloat16) if k in ("up", "down") else v for k, v in c.items()} for m, c in changes.items()}
    adapter = write_adapter(tmp_path / "small.safetensors", "kohya", changes)
    stats = lora_cache.merge(model, [adapter], cache_root=tmp_path / "cache", progress=False, rounding="merge")
    assert stats.built == 40 and stats.fallen_back == 0
    cached = {n: p.detach().clone() for n, p in model.named_parameters()}
    lora_cache.unmerge(model)
    lora_cache.merge(model, [adapter], progress=False, enabled=False, rounding="merge")
    for name, weight in model.named_parameters():
        assert torch.equal(cached[name], weight), name
