"""Rounding loss: how much of a LoRA's update survives rounding the merged weight.

The merge sums ``W + d`` in fp32 and rounds once to the weight's dtype. Where ``d`` sits
below half a step (ulp) of the bf16 or fp16 weight it is added to, as a distilled
(Turbo-style) LoRA's deltas do, the rounded sum is ``W`` again: the update is gone and
nothing says so. A Linear's output adds its deltas coherently over thousands of inputs,
so the same update kept at run time (``W x + scale * B (A x)``) changes the output by
many of its ulps: the image changes, the merged weight does not.

The share that survives is measured as the projection of what the rounding kept on the
update, ``<round(W + d) - W, d> / <d, d>`` (1: all of it, 0: none, over 1: rounding
made it larger), on a sample of each layer (:data:`SAMPLE_ROWS` rows by
:data:`SAMPLE_COLUMNS` columns, evenly spaced, so the figure is the same on every
start); the share lost is one minus that. Rounding to nearest is unbiased, so random
rounding error does not count as loss, a systematic one does. Measured on bf16 weights
of one binade, updates spread as a LoRA's are (normal, standard deviation in ulps of the
weight): 0.1 ulp loses 100%, 0.3 ulp 33%, 0.5 ulp 1%, one ulp or more under 0.2%. An update whose every element has the same size is the
exception (0.7 ulp of each rounds up to one: 43% gained), hence the absolute value below.

:data:`THRESHOLD` (5%) is the share, lost or gained, from which a layer is *lossy*: it
acts as the LoRA's strength changed by that share, and 5% is half the smallest strength
step (0.1) LoRAs are tuned with, well above the measure's noise on its sampled rows
(under 1% from half an ulp up). Lossy layers are handled by a policy (:data:`POLICIES`):

- ``runtime`` (the default, so that no LoRA is weakened without a word): those layers
  are not merged; their terms are added at run time (:mod:`lora_cache.placement.runtime_lora`) on
  the base, which stays the mapped checkpoint (no anonymous copy). A layer run time
  cannot express (not an ``nn.Linear``) is merged anyway, and the line says so;
- ``merge``: merged anyway (what ``fuse_lora`` and ``merge_and_unload`` do), said once;
- ``refuse``: :class:`RoundingLossError` before any weight changes.

Whatever the policy, one line per combination names the layers and the share lost.
Only bf16 and fp16 weights are measured (fp32 keeps 2**-24 of a weight: nothing a LoRA
loses), and not tensor-parallel parts (their whole layer is).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace

import torch

from hostmem.torch_threads import one_thread
from hostmem.vault.read_ahead import will_need

from ..targets.layer_target import LayerTarget
from ..terms.dora_lycoris import COLUMNS
from ..compute.merge_math import Term, UnsupportedAdapterError, add_terms, column_scales
from ..terms.delta import Delta

__all__ = ["POLICIES", "SAMPLE_ROWS", "THRESHOLD", "OverflowingUpdateError", "RoundingCheck", "RoundingLossError",
           "RoundingWarning", "check_policy", "decide", "has_values", "is_stand_in", "lost_share", "measure",
           "split_lossy"]

THRESHOLD = 0.05  # share of the update lost from which a layer is lossy (see the module's docstring)
SAMPLE_ROWS = 32  # rows of each layer the share is measured on
SAMPLE_COLUMNS = 512  # and columns of those rows (every column for DoRA, whose norm is the row's)
POLICIES = ("runtime", "merge", "refuse")
_MEASURED = (torch.bfloat16, torch.float16)
_SHOWN = 3


class RoundingLossError(UnsupportedAdapterError):
    """A merge would lose a material share of an adapter's update, and the policy refuses."""


class RoundingWarning(UserWarning):
    """Layers lose a material share of their update to rounding (the check's one line)."""


class OverflowingUpdateError(UnsupportedAdapterError):
    """Merging the adapters would write inf or NaN where the base weight is finite: an
    adapter's values or strength far out of range (each value finite, their product not)."""


def check_policy(policy: str) -> str:
    """``policy`` if it is one of :data:`POLICIES`, else a ValueError saying which there are."""
    if policy not in POLICIES:
        raise ValueError(f"rounding policy {policy!r} is not one of {', '.join(POLICIES)}")
    return policy


def _spread(count: int, most: int) -> slice:
    """At most ``most`` evenly spaced indices of ``count``, as a slice (a view: no gather)."""
    step = -(-count // most)
    return slice(0, count, step)


def _sampled(delta: Delta, rows: slice, cols: slice) -> Delta:
    """``delta`` on the sampled rows and columns of its layer, as 2-D matrices: views of the
    factors, made fp32 only at that size, so a measure (every start, every switch) costs
    a few small blocks, not the layer's factors."""
    def flat(tensor):
        return tensor.reshape(tensor.shape[0], -1) if tensor.dim() > 1 else tensor.reshape(-1, 1)

    return replace(delta,
                   factors=None if delta.factors is None else delta.factors.sampled(rows, cols),
                   up=None if delta.up is None else flat(delta.up)[rows],
                   down=None if delta.down is None else flat(delta.down)[:, cols],
                   diff=None if delta.diff is None else flat(delta.diff)[rows, cols],
                   magnitude=None if delta.magnitude is None or delta.dora == COLUMNS else delta.magnitude[rows])


def _sampled_rows(base: torch.Tensor) -> tuple[torch.Tensor, slice]:
    """``(base as a 2-D matrix, the rows sampled of it)``."""
    flat = base.reshape(base.shape[0], -1) if base.dim() > 1 else base.reshape(-1, 1)
    return flat, _spread(flat.shape[0], SAMPLE_ROWS if base.dim() > 1 else flat.shape[0])


def _is_measured(target: LayerTarget) -> bool:
    """Whether :func:`lost_share` measures ``target``: a floating-point base of a whole
    layer (a tensor-parallel part's share is the whole layer's)."""
    base = target.current
    return base.is_floating_point() and base.dim() > 0 and target.shard is None


def _read_ahead_sample(target: LayerTarget) -> None:
    """Ask the kernel to start reading the pages of ``target``'s sampled rows (a mapped
    base's; a hint). Measured one after another, each row is a page fault that waits for
    its read (and the read-around the kernel adds to it) before the next is asked for:
    1 GiB of cold base took 0.3-0.8 s so; asked for all at once, the reads are in the
    disk's queue together, and only the sampled pages are read."""
    if not _is_measured(target):
        return
    flat, rows = _sampled_rows(target.current.detach())
    for row in range(rows.start, rows.stop, rows.step):
        will_need(flat[row])


def _update_rows(target: LayerTarget, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(base, the merge's fp32 change of it)`` on the sampled rows and columns of ``target``:
    its terms added to the base (and DoRA's rows rescaled) as the merge adds them. DoRA
    rescales by a whole row's norm, so its rows are taken whole."""
    base = target.current.detach()
    flat, rows = _sampled_rows(base)
    dora = any(d.magnitude is not None for d in target.deltas)
    cols = slice(None) if dora else _spread(flat.shape[1], SAMPLE_COLUMNS)
    before = flat[rows, cols].to(device=device, dtype=torch.float32)
    total = before.clone()
    columns = column_scales(base, target.deltas, device)  # a column-axis DoRA's norms: the whole layer's
    add_terms(total, [Term.of(_sampled(d, rows, cols), device, columns=c) for d, c in zip(target.deltas, columns)],
              slice(None))
    return before, total - before


def lost_share(target: LayerTarget) -> float:
    """The share of ``target``'s update that rounding its merged weight loses (1: all of it;
    negative where rounding makes it larger). Raises :class:`OverflowingUpdateError` where the
    merged weight is inf or NaN on the sampled rows and the base is not."""
    if not _is_measured(target):
        return 0.0
    base = target.current.detach()
    before, update = _update_rows(target, base.device)
    rounded = (before + update).to(base.dtype).float()
    _check_finite(target, before, update, rounded)
    if base.dtype not in _MEASURED:
        return 0.0
    kept = rounded - before
    energy = float(torch.dot(update.flatten(), update.flatten()))
    if energy == 0.0 or not math.isfinite(energy):
        return 0.0
    survived = float(torch.dot(kept.flatten(), update.flatten())) / energy
    return 1.0 - survived


def _check_finite(target: LayerTarget, before: torch.Tensor, update: torch.Tensor, rounded: torch.Tensor) -> None:
    bad = torch.isfinite(before) & ~torch.isfinite(rounded)
    if not bool(bad.any()):
        return
    for delta in target.deltas:  # a file that holds NaN or inf itself is refused as such, naming the key
        if delta.values_check is not None:
            delta.values_check()
    finite = update[torch.isfinite(update)]
    largest = float(finite.abs().max()) if finite.numel() else math.inf
    sources = sorted({d.source for d in target.deltas})
    raise OverflowingUpdateError(
        f"{', '.join(sources)}: merging into {target.name} gives inf or NaN in {int(bad.sum())} of {bad.numel()} "
        f"sampled values where the base weight is finite (largest finite change {largest:.3g}; "
        f"{target.current.dtype} holds up to {torch.finfo(target.current.dtype).max:.3g}): the adapter's values or "
        "its strength are far out of range. Nothing was merged; check the values the file holds and the "
        "strength")


@dataclass
class RoundingCheck:
    """What the rounding check found for one combination, for :class:`MergeStats` and the report.

    ``lost``: share lost by each lossy layer (over :data:`THRESHOLD`); ``at_runtime``:
    those kept at run time; ``merged_anyway``: those merged although lossy, with why;
    ``recorded``: the shares were read from the combination's record, not measured.
    """

    policy: str = "runtime"
    threshold: float = THRESHOLD
    measured: int = 0
    lost: dict[str, float] = field(default_factory=dict)
    at_runtime: list[str] = field(default_factory=list)
    merged_anyway: dict[str, str] = field(default_factory=dict)
    recorded: bool = False  # the shares came from the combination's record (lora_cache.placement.rounding_memo)

    def summary(self) -> str:
        """Which layers lose how much: the worst few by name, with their shares."""
        worst = sorted(self.lost.items(), key=lambda item: -abs(item[1]))
        named = ", ".join(f"{name} {_share(share)}" for name, share in worst[:_SHOWN])
        more = f" and {len(worst) - _SHOWN} more" if len(worst) > _SHOWN else ""
        return (f"{len(worst)} layer(s) lose (or gain) over {self.threshold:.0%} of their LoRA update when the merged "
                f"weight is rounded to its dtype ({named}{more})")

    def line(self) -> str | None:
        """The one line that says what was lost and what was done about it (None: nothing lost)."""
        if not self.lost:
            return None
        done = []
        if self.at_runtime:
            done.append(f"{len(self.at_runtime)} kept at run time on the mapped base")
        if self.merged_anyway:
            reasons = sorted(set(self.merged_anyway.values()))
            done.append(f"{len(self.merged_anyway)} merged anyway ({'; '.join(reasons)})")
        return (f"lora merge: {self.summary()}: {', '.join(done)} (rounding='runtime' keeps such layers at "
                "run time, 'merge' merges them anyway, 'refuse' refuses)")

    def to_dict(self) -> dict:
        return {"policy": self.policy, "threshold": self.threshold, "measured": self.measured,
                "lost": dict(self.lost), "at_runtime": list(self.at_runtime),
                "merged_anyway": dict(self.merged_anyway), "recorded": self.recorded}


def is_stand_in(target: LayerTarget) -> bool:
    """Whether ``target`` lies in a checkpoint's module tree (``hostmem lora merge`` builds
    without the model's class: :func:`lora_cache.placement.layers.checkpoint_module`), not in a model:
    its lossy layers are left unbuilt, for the server's start to keep at run time."""
    return type(target.module) is torch.nn.Module


def _share(share: float) -> str:
    return f"{share:.0%} lost" if share >= 0 else f"{-share:.0%} gained"


def has_values(target: LayerTarget) -> bool:
    """False for a target planned from a conversion record (its factors are on the meta device)."""
    return all(t is None or t.device.type != "meta"
               for d in target.deltas for t in (d.up, d.down, d.diff, *(d.factors.tensors() if d.factors else ())))


@one_thread()  # blocks of a few KiB: a thread pool's wake-ups cost more than they compute
def measure(targets: list[LayerTarget]) -> tuple[dict[str, float], int, bool]:
    """``(share lost by each lossy target, targets measured, every target had values)``.

    Targets without values (planned from a conversion record: see
    :mod:`lora_cache.adapters.conversion_memo`) are not measured; the merge measures them
    once their values are read (every lossy layer is a miss, never stored under the
    ``runtime`` policy)."""
    lost, measured, whole = {}, 0, True
    for target in targets:
        if has_values(target):
            _read_ahead_sample(target)
    for target in targets:
        if not has_values(target):
            whole = False
            continue
        measured += 1
        share = lost_share(target)
        if abs(share) > THRESHOLD:
            lost[target.name] = share
    return lost, measured, whole


def decide(targets: list[LayerTarget], lost: dict[str, float], measured: int,
           policy: str = "runtime") -> tuple[list[LayerTarget], list[LayerTarget], RoundingCheck]:
    """``(to merge, to keep at run time, what was found)`` for ``targets`` whose lossy ones
    lose ``lost`` (:func:`measure`'s, or a record of it: :mod:`lora_cache.placement.rounding_memo`).
    A lossy layer run time cannot express in this model is merged anyway, said so;
    ``refuse`` raises :class:`RoundingLossError` naming the layers."""
    from .runtime_lora import unsupported_reason

    check = RoundingCheck(check_policy(policy), measured=measured)
    to_merge, at_runtime = [], []
    for target in targets:
        if target.name not in lost:
            to_merge.append(target)
            continue
        check.lost[target.name] = lost[target.name]
        if policy == "refuse":
            continue
        reason = unsupported_reason(target) if policy == "runtime" else None
        if policy == "runtime" and (reason is None or is_stand_in(target)):
            at_runtime.append(target)
            check.at_runtime.append(target.name)
        else:
            to_merge.append(target)
            why = "rounding='merge'" if policy == "merge" else "not expressible at run time"
            check.merged_anyway[target.name] = why
    if check.lost and policy == "refuse":
        raise RoundingLossError(
            f"lora merge refused (rounding='refuse'): {check.summary()}; nothing was merged. Pass "
            "rounding='runtime' to keep those layers at run time, or rounding='merge' to merge them anyway")
    return to_merge, at_runtime, check


def split_lossy(targets: list[LayerTarget],
                policy: str = "runtime") -> tuple[list[LayerTarget], list[LayerTarget], RoundingCheck]:
    """``(to merge, to keep at run time, what was found)`` for ``targets`` under ``policy``:
    :func:`measure`, then :func:`decide`."""
    check_policy(policy)
    lost, measured, _ = measure(targets)
    return decide(targets, lost, measured, policy)


def say(check: RoundingCheck) -> None:
    """Warn with the check's one line, where something was lost."""
    line = check.line()
    if line is not None:
        warnings.warn(line, RoundingWarning, stacklevel=3)
