"""Which kernel sums each layer: measured on this machine, remembered, named by the key."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch

from ..compute.buffers import Scratch, compute_device, host_buffer
from ..compute.merge_math import (BF16_ADDMM, FP32_ROWS, Delta, _bf16_addmm_rounds_once, merged_weight, one_pass_kind,
                          row_blocks)
from .wisdom import ENTRIES, FACTS, Wisdom, entry_key, machine
from .workers import block_workers, worker_count

__all__ = ["KernelPlan", "measure_kernels", "plan_kernels", "shape_class"]

CANDIDATES = (BF16_ADDMM, FP32_ROWS)
_REPEATS = 3  # timed runs of each kernel, after one untimed run that touches the buffers
ROUNDS_ONCE = "bf16-addmm-rounds-once"  # the fact, in the wisdom, of how torch's bf16 addmm rounds


def _bucket(n: int) -> int:
    """``n`` rounded up to a power of two: layers of about the same width share a class."""
    return 1 << max(0, int(n) - 1).bit_length()


def shape_class(shape: tuple[int, ...], dtype: torch.dtype, deltas: list[Delta], device) -> str | None:
    """The class a layer's kernel is timed and remembered under; None where only
    :data:`~lora_cache.compute.merge_math.FP32_ROWS` applies to a layer of this kind (nothing to
    choose). Where torch's bf16 addmm does not round as the merge must, no plan holds a
    class (:func:`plan_kernels`), so every layer is summed by FP32_ROWS."""
    if not one_pass_kind(dtype, len(shape), deltas, device):
        return None
    cols, rank = math.prod(shape[1:]), deltas[0].down.shape[0]
    return f"bf16-lora/cols{_bucket(cols)}/rank{_bucket(rank)}"


@dataclass(frozen=True)
class KernelPlan:
    """The kernel chosen for each shape class of a merge (classes not named: FP32_ROWS)."""

    choices: tuple[tuple[str, str], ...] = ()

    def kernel_for(self, shape: tuple[int, ...], dtype: torch.dtype, deltas: list[Delta], device) -> str:
        chosen = dict(self.choices).get(shape_class(tuple(shape), dtype, deltas, device))
        return chosen or FP32_ROWS

    def describe(self) -> str:
        """The choices as the cache key records them: ``class=kernel`` joined by ``;``."""
        return ";".join(f"{cls}={kernel}" for cls, kernel in self.choices)


def _synthetic(rows: int, cols: int, rank: int) -> tuple[torch.Tensor, Delta]:
    """A random bf16 layer and adapter, the layer in a mapping of its own (unmapped when
    dropped: a heap block this size could stay with the C allocator after the timing)."""
    gen = torch.Generator().manual_seed(0)
    base = host_buffer(rows * cols * 2).view(torch.bfloat16).view(rows, cols).normal_(generator=gen)
    up = torch.empty(rows, rank, dtype=torch.bfloat16).normal_(std=0.01, generator=gen)
    down = torch.empty(rank, cols, dtype=torch.bfloat16).normal_(std=cols**-0.5, generator=gen)
    return base, Delta("timing", up, down, 0.5)


def measure_kernels(rows: int, cols: int, rank: int) -> dict:
    """Time every candidate on a synthetic bf16 layer of this width and rank, as a build
    runs it (the block workers, a reused scratch and output buffer), and pick the fastest.

    The layer is two blocks per worker tall (at most ``rows``), so every worker is busy
    and the memory bus shared as in a build; each kernel runs once untimed (fresh pages
    cost more to touch than to fill again), then the kernels take turns, best of
    :data:`_REPEATS`. Returns the entry the wisdom keeps: the kernel and seconds per GiB.
    """
    step = row_blocks((rows, cols), torch.device("cpu"))[0].stop
    rows = max(1, min(rows, 2 * worker_count() * step))
    base, delta = _synthetic(rows, cols, rank)
    out = host_buffer(base.nbytes).view(torch.bfloat16).view(rows, cols)
    scratch, best = Scratch("cpu"), {kernel: math.inf for kernel in CANDIDATES}
    with block_workers(torch.device("cpu")) as workers:
        for attempt in range(_REPEATS + 1):
            for kernel in CANDIDATES:
                started = time.perf_counter()
                merged_weight(base, [delta], out, scratch, workers, kernel=kernel)
                if attempt:
                    best[kernel] = min(best[kernel], time.perf_counter() - started)
    scratch.release()
    per_gib = {kernel: seconds * (1 << 30) / base.nbytes for kernel, seconds in best.items()}
    return {"kernel": min(per_gib, key=per_gib.get), "seconds_per_gib": per_gib,
            "measured": {"rows": rows, "cols": cols, "rank": rank}}


class _Wisdoms:
    """The wisdom of several roots in order: a choice is recalled from the first that
    knows it, and a new one kept in the last (see :func:`plan_kernels`)."""

    def __init__(self, roots):
        self.all = [Wisdom(r) for r in roots] or [Wisdom(None)]
        self.keeper = self.all[-1]  # a read-only root keeps new timings in this process only

    def recall(self, key: str, section: str = ENTRIES) -> dict | None:
        return next((e for w in self.all if (e := w.recall(key, section)) is not None), None)

    def recording(self, section: str = ENTRIES):
        return self.keeper.recording(section)


def _wisdoms(root) -> _Wisdoms:
    return _Wisdoms([root] if root is None or isinstance(root, (str, os.PathLike)) else list(root))


def plan_kernels(layers, device=None, root=None) -> KernelPlan:
    """Choose the kernel of every shape class among ``layers`` (``(shape, dtype, deltas)``
    triples): as remembered in ``root``'s wisdom (or this process's), else timed now on
    the class's largest layer (a fraction of a second per class, once per machine) and
    remembered. ``device``: where the sum runs. ``root`` may be a list of roots
    (``lora_cache.key.combination.kernel_roots``): the others first, whose recorded
    choices win (the keys of what they hold were made with them), and the root that
    keeps new timings last."""
    device = torch.device(device) if device is not None else compute_device()
    largest: dict[str, tuple[int, int, int]] = {}
    for shape, dtype, deltas in layers:
        cls = shape_class(tuple(shape), dtype, deltas, device)
        if cls is not None:
            found = (shape[0], math.prod(shape[1:]), deltas[0].down.shape[0])
            largest[cls] = max(largest.get(cls, found), found)
    if not largest:
        return KernelPlan()
    wisdoms, threads = _wisdoms(root), worker_count()
    if not addmm_rounds_once(wisdoms, threads):
        return KernelPlan()
    keys = {cls: entry_key("bfloat16", cls, threads) for cls in largest}
    chosen = {cls: wisdoms.recall(key) for cls, key in keys.items()}
    if any(entry is None for entry in chosen.values()):
        with wisdoms.recording() as record:
            for cls, entry in chosen.items():
                chosen[cls] = entry or record(keys[cls], lambda cls=cls: measure_kernels(*largest[cls]))
    return KernelPlan(tuple(sorted((cls, entry["kernel"]) for cls, entry in chosen.items())))


def addmm_rounds_once(wisdom: Wisdom | _Wisdoms, threads: int) -> bool:
    """Whether torch's bf16 addmm rounds once on this machine, as the merge must (see
    :func:`lora_cache.compute.merge_math.one_pass_applies`), remembered in ``wisdom``'s facts.

    Finding out takes a bf16 addmm, and a process's first one costs milliseconds (the
    math library sets itself up): a start served wholly from the cache would pay that for
    nothing, so the answer is kept beside the timings, under the same machine description.
    """
    key = entry_key("bfloat16", ROUNDS_ONCE, threads)
    known = wisdom.recall(key, FACTS)
    if known is None:
        with wisdom.recording(FACTS) as record:
            known = record(key, lambda: {"rounds_once": _bf16_addmm_rounds_once()})
    return known.get("rounds_once") is True


def plan_for_targets(targets, device=None, root=None) -> KernelPlan:
    """:func:`plan_kernels` for the layers of a merge (``LayerTarget``\\ s)."""
    return plan_kernels(((tuple(t.current.shape), t.current.dtype, t.deltas) for t in targets), device, root)
