"""A layer streamed to the vault while it is summed: the handoff between the merge and the writer."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from hostmem.vault.handoff import Handoff, HandoffCancelled
from lora_cache.kernels import block_workers
from lora_cache.compute.merge_math import BF16_ADDMM, FP32_ROWS, Delta, Scratch, host_buffer, merged_weight, sums_in_output
from hostmem.vault import Vault, cache_key
from hostmem.vault.durable import TMP_PREFIX
from hostmem.vault.layer_file import data_crc32

SHAPE = (2600, 4099)  # 20.3 MiB of bf16: two stretches and a tail; rows not a whole page


def _key(tag: str):
    return cache_key({"shards": [{"path": f"/models/{tag}.safetensors", "digest": tag}]}, [], "bfloat16", "handoff")


def _in_thread(call, *args) -> threading.Thread:
    thread = threading.Thread(target=call, args=args, daemon=True)
    thread.start()
    return thread


def _ends_within(thread: threading.Thread, seconds: float = 10.0) -> bool:
    thread.join(seconds)
    return not thread.is_alive()


def _leftovers(folder: str) -> list[str]:
    return [f for f in os.listdir(folder) if f.startswith(TMP_PREFIX)]


def test_the_consumer_waits_for_published_bytes_and_a_cancel_wakes_it():
    handoff = Handoff(1000)
    handoff.publish(300)
    assert handoff.wait_ready(0, 200) == 300  # enough already
    got = []
    waiter = _in_thread(lambda: got.append(handoff.wait_ready(300, 500)))
    time.sleep(0.05)
    assert waiter.is_alive()  # 300 + 500 not there yet
    handoff.publish(700)
    time.sleep(0.05)
    assert waiter.is_alive()
    handoff.publish(5000)  # clipped to the buffer
    assert _ends_within(waiter) and got == [1000]
    assert handoff.wait_ready(900, 10**9) == 1000  # at_least past the end asks for the rest
    cancelled = Handoff(10)
    cancelled.cancel()
    with pytest.raises(HandoffCancelled, match="0 of 10 bytes"):
        cancelled.wait_ready(0, 1)


def test_the_producer_reuses_bytes_only_once_the_consumer_released_them():
    handoff = Handoff(100)
    reused = _in_thread(handoff.wait_released, 60)
    handoff.release(50)
    time.sleep(0.05)
    assert reused.is_alive()
    handoff.release(60)
    assert _ends_within(reused)
    handoff.release()  # all of it
    assert _ends_within(_in_thread(handoff.wait_released, 100))


def _produce(buffer: torch.Tensor, wanted: torch.Tensor, handoff: Handoff, rows_per_step: int) -> None:
    """Copy ``wanted`` into ``buffer`` a few rows at a time, publishing each step, slowly."""
    row_bytes = buffer[0].numel() * buffer.element_size()
    for start in range(0, buffer.shape[0], rows_per_step):
        stop = min(start + rows_per_step, buffer.shape[0])
        buffer[start:stop].copy_(wanted[start:stop])
        handoff.publish(stop * row_bytes)
        time.sleep(0.002)


def test_a_streamed_put_writes_only_published_bytes_and_gives_the_buffer_back(tmp_path):
    wanted = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    buffer = host_buffer(wanted.nbytes).view(torch.bfloat16).view(SHAPE)
    buffer.fill_(float("nan"))  # a byte written before it was published would show as NaN
    handoff = Handoff(wanted.nbytes)
    vault = Vault(tmp_path / "root")
    with vault.open(_key("stream"), {"w": (SHAPE, torch.bfloat16)}) as session:
        producer = _in_thread(_produce, buffer, wanted, handoff, 97)
        view = session.put("w", buffer, handoff=handoff)
        assert _ends_within(producer)
        assert view is not None, session.last_error
        assert torch.equal(view, wanted)
        entry = session.layers["w"]
        assert data_crc32(os.path.join(session.folder, entry.file)) == entry.crc32
        assert session.complete and not _leftovers(session.folder)
    assert _ends_within(_in_thread(handoff.wait_released, wanted.nbytes), 0.5)
    with vault.open(_key("stream")) as session:
        assert torch.equal(session.get("w", SHAPE, torch.bfloat16), wanted)


def test_a_cancelled_merge_leaves_no_file_and_the_session_writable(tmp_path):
    buffer = host_buffer(4 << 20).view(torch.float32).view(1024, 1024)
    handoff = Handoff(buffer.nbytes)
    vault = Vault(tmp_path / "root")
    with vault.open(_key("cancel")) as session:
        _in_thread(lambda: (handoff.publish(1 << 20), time.sleep(0.05), handoff.cancel()))
        with pytest.raises(HandoffCancelled):
            session.put("w", buffer, handoff=handoff)
        assert not _leftovers(session.folder) and "w" not in session.layers
        assert _ends_within(_in_thread(handoff.wait_released, buffer.nbytes), 0.5)
        assert session.writable and session.put("w", torch.ones(64, 64)) is not None


def test_a_refused_put_gives_the_whole_buffer_back_without_waiting_for_it(tmp_path):
    vault = Vault(tmp_path / "root", max_size="4KiB")
    handoff = Handoff(1 << 20)  # nothing will ever be published
    with vault.open(_key("refused"), {"w": ((512, 512), torch.float32)}) as session:
        assert session.put("w", torch.empty(512, 512), handoff=handoff) is None
        assert "no room" in session.last_error
    assert _ends_within(_in_thread(handoff.wait_released, 1 << 20), 0.5)


@pytest.mark.parametrize("one_pass", [True, False], ids=["sums-in-output", "fp32-scratch"])
def test_the_merge_claims_each_stretch_before_writing_it_and_publishes_in_order(one_pass):
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(3000, 640, generator=gen).to(torch.bfloat16)
    up, down = torch.randn(3000, 8, generator=gen), torch.randn(8, 640, generator=gen)
    deltas = [Delta("a", up.to(torch.bfloat16), down.to(torch.bfloat16), 0.5)]
    kernel = BF16_ADDMM if one_pass else FP32_ROWS
    out = torch.empty_like(base)
    assert sums_in_output(base, deltas, out, torch.device("cpu"), kernel) == one_pass
    claims, published = [], []

    def claim(end):
        assert not published or end > published[-1]  # each stretch is claimed before it is final
        claims.append(end)

    with block_workers(torch.device("cpu")) as workers:
        merged_weight(base, deltas, out, Scratch("cpu"), workers, claim, published.append, kernel=kernel)
    assert published == sorted(published) and published[-1] == base.nbytes and len(published) > 1
    assert sorted(claims) == published
    assert torch.equal(out, merged_weight(base, deltas, torch.empty_like(base), Scratch("cpu"), kernel=kernel))


def test_a_streamed_merge_needs_a_contiguous_out():
    base = torch.zeros(8, 8)
    with pytest.raises(ValueError, match="contiguous"):
        merged_weight(base, [], torch.zeros(8, 8).t(), Scratch("cpu"), publish=lambda end: None)


def test_the_sum_runs_at_the_priority_of_the_process_that_waits_for_it():
    """A server waits for the build: its summing threads get their fair share of the CPU,
    not what other load on the host leaves them."""
    def nice_of_this_thread() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    own = nice_of_this_thread()
    with block_workers(torch.device("cpu")) as workers:
        seen = set(workers.map(lambda _: nice_of_this_thread(), range(8)))
    assert seen == {own}
