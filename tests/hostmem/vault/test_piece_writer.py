"""The vault's streamed writes: pieces on their way at once, handed back to the merge in order."""

from __future__ import annotations

import os
import threading
import zlib
from concurrent.futures import Future

import pytest
import torch

from hostmem.vault import Vault, cache_key
from hostmem.vault.durable import TMP_PREFIX
from hostmem.vault.handoff import Handoff, HandoffCancelled
from hostmem.vault.layer_file import read_layer_file, write_layer
from hostmem.vault.piece_writer import IN_FLIGHT, PIECE_BYTES, _Released, write_pieces
from lora_cache.compute.merge_math import host_buffer

MiB = 1024 * 1024


class _Crc:
    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)


def _buffer(nbytes: int, seed: int = 0) -> torch.Tensor:
    """``nbytes`` of random bytes on the merge's own kind of buffer (page-aligned, 2 MiB pages)."""
    out = host_buffer(nbytes)
    out.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return out


def _open(path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)


def _in_thread(call, *args) -> tuple[threading.Thread, list]:
    outcome: list = []

    def run():
        try:
            outcome.append(call(*args))
        except BaseException as exc:  # the test looks at it
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def _three_pieces() -> tuple[Handoff, _Released, list[Future]]:
    """A 30-byte handoff and its three 10-byte pieces, issued in order, none finished."""
    handoff = Handoff(30)
    released = _Released(handoff)
    futures = [Future() for _ in range(3)]
    for i, future in enumerate(futures):
        released.issued(10 * i, 10 * (i + 1))
        future.add_done_callback(lambda f, start=10 * i: released.done(start, f))
    return handoff, released, futures


def test_pieces_that_finish_out_of_order_are_handed_back_in_order():
    handoff, released, futures = _three_pieces()
    released.summed(30)
    futures[1].set_result(None)
    futures[2].set_result(None)
    assert handoff._released == 0  # the first piece is still on its way: nothing may be overwritten
    futures[0].set_result(None)
    assert handoff._released == 30


def test_a_written_piece_goes_back_only_once_it_is_checksummed():
    """The checksum of a piece is taken after it is issued: the merge may not overwrite
    bytes the checksum has yet to read, even when the disk has them already."""
    handoff, released, futures = _three_pieces()
    for future in futures:
        future.set_result(None)
    assert handoff._released == 0
    released.summed(10)
    assert handoff._released == 10
    released.summed(30)
    assert handoff._released == 30
    failed = Handoff(20)
    released = _Released(failed)
    released.issued(0, 10)
    future = Future()
    future.add_done_callback(lambda f: released.done(0, f))
    future.set_exception(OSError("no space"))
    assert failed._released == 0  # a failed piece is never handed back as written


def test_the_merge_gets_each_piece_back_before_the_rest_is_published(tmp_path):
    """The next layer may overwrite the first piece while this layer's end is still being
    summed: with the whole layer's bytes on their way in one write it could not."""
    nbytes = 8 * PIECE_BYTES + 12345  # a tail that is not a whole page
    data = _buffer(nbytes)
    handoff, digest = Handoff(nbytes), _Crc()
    fd = _open(tmp_path / "layer.bin")
    try:
        writer, outcome = _in_thread(write_pieces, fd, str(tmp_path / "layer.bin"), memoryview(data.numpy()), 0,
                                     data.data_ptr(), handoff, digest)
        handoff.publish(2 * PIECE_BYTES)  # two pieces of eight
        reused, _ = _in_thread(handoff.wait_released, PIECE_BYTES)
        reused.join(10)
        assert not reused.is_alive(), "the first piece was not handed back while the rest was unpublished"
        assert writer.is_alive()  # it waits for the rest
        handoff.publish(nbytes)
        writer.join(30)
        assert outcome == [None]
    finally:
        os.close(fd)
    assert handoff._released == nbytes
    assert (tmp_path / "layer.bin").read_bytes() == data.numpy().tobytes()
    assert digest.value == zlib.crc32(data.numpy())


def test_a_cancelled_merge_ends_the_writer_after_its_pieces_in_flight(tmp_path):
    nbytes = (IN_FLIGHT + 4) * PIECE_BYTES
    data = _buffer(nbytes, seed=1)
    handoff = Handoff(nbytes)
    fd = _open(tmp_path / "layer.bin")
    try:
        writer, outcome = _in_thread(write_pieces, fd, str(tmp_path / "layer.bin"), memoryview(data.numpy()), 0,
                                     data.data_ptr(), handoff, _Crc())
        handoff.publish(3 * PIECE_BYTES)
        handoff.cancel()
        writer.join(30)
        assert not writer.is_alive() and isinstance(outcome[0], HandoffCancelled)
        assert not [t for t in threading.enumerate() if t.name.startswith("hostmem-vault-write")]
    finally:
        os.close(fd)
    assert handoff._released <= 3 * PIECE_BYTES  # nothing past what was written is handed back


def test_a_streamed_layer_file_holds_the_bytes_and_their_crc(tmp_path):
    rows, cols = 1031, 4099  # odd sizes: the data ends mid-page
    merged = host_buffer(rows * cols * 2).view(torch.bfloat16).view(rows, cols)
    merged.copy_(torch.randn(rows, cols, generator=torch.Generator().manual_seed(2)))
    handoff = Handoff(merged.nbytes)
    publisher, _ = _in_thread(lambda: [handoff.publish(end) for end in range(0, merged.nbytes + MiB, MiB)])
    entry = write_layer(str(tmp_path), "blocks.0.weight", merged, handoff=handoff)
    publisher.join(10)
    path = tmp_path / entry.file
    assert read_layer_file(str(path)) == entry
    stored = path.read_bytes()[-merged.nbytes:]
    assert stored == merged.view(torch.uint8).numpy().tobytes()
    assert entry.crc32 == f"{zlib.crc32(stored):08x}"


def test_a_write_error_reaches_the_put_and_leaves_no_piece_handed_back_past_it(tmp_path):
    data = _buffer(4 * PIECE_BYTES, seed=3)
    handoff = Handoff(data.numel())
    handoff.publish(data.numel())
    fd = os.open(tmp_path / "layer.bin", os.O_RDONLY | os.O_CREAT, 0o600)  # a descriptor that cannot write
    try:
        with pytest.raises(OSError):
            write_pieces(fd, str(tmp_path / "missing" / "layer.bin"), memoryview(data.numpy()), 0, data.data_ptr(),
                         handoff, _Crc())
    finally:
        os.close(fd)
    assert handoff._released == 0


def _key(tag: str):
    return cache_key({"shards": [{"path": f"/models/{tag}.safetensors", "digest": tag}]}, [], "bfloat16", "pieces")


def _layer(seed: int) -> torch.Tensor:
    return torch.randn(512, 1024, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_a_layer_is_written_while_the_one_before_is_sealed_and_both_are_served(tmp_path):
    vault = Vault(tmp_path / "root")
    first, second = _layer(4), _layer(5)
    with vault.open(_key("overlap")) as session:
        written = session.put_data("a", first)
        following = session.put_data("b", second)  # before the first is sealed
        folder = session.folder
        assert sorted(os.listdir(folder)) == sorted(f for f in os.listdir(folder) if f.startswith(TMP_PREFIX))
        assert torch.equal(session.seal_put(written), first) and torch.equal(session.seal_put(following), second)
        assert session.stats["layers_written"] == 2
    with vault.open(_key("overlap")) as session:
        assert torch.equal(session.get("a", (512, 1024), torch.bfloat16), first)
        assert torch.equal(session.get("b", (512, 1024), torch.bfloat16), second)


def test_a_failed_seal_fails_the_puts_after_it_and_leaves_nothing_partial(tmp_path):
    vault = Vault(tmp_path / "root")
    with vault.open(_key("failed-seal")) as session:
        written = session.put_data("a", _layer(6))
        following = session.put_data("b", _layer(7))
        os.unlink(written.tmp)  # the rename into place then fails
        assert session.seal_put(written) is None and session.seal_put(following) is None
        assert session.put_data("c", _layer(8)) is None
        assert not session.writable and "could not write layer 'a'" in session.last_error
        assert not [f for f in os.listdir(session.folder) if f.startswith(TMP_PREFIX)]
        assert session.layers == {}
