"""The merge math, in one place: base + sum of scaled up @ down (and full deltas).

The in-place path and the cached path both call :func:`merged_weight`, so the bytes
they produce are identical: the sum is taken in fp32 on a one-layer temporary on the
compute device (the GPU when there is one, else the CPU), in the order the adapters
were given, and cast back to the base dtype once, at the end.

Variants whose merge is not ``W + scale * B @ A`` (DoRA's magnitude vectors, LoHa,
LoKr, ...) are refused with the key named: merging them as plain LoRA would be wrong
without any error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = [
    "Delta",
    "Scratch",
    "UnsupportedAdapterError",
    "compute_device",
    "lora_scale",
    "merged_weight",
    "refuse_unsupported",
]

# Markers of adapter variants whose merge is not W + scale * B @ A.
_UNSUPPORTED = {
    "lora_magnitude_vector": "DoRA (magnitude vector)",
    "dora_scale": "DoRA (dora_scale)",
    "hada_w1_a": "LoHa",
    "hada_w1_b": "LoHa",
    "hada_w2_a": "LoHa",
    "hada_w2_b": "LoHa",
    "hada_t1": "LoHa",
    "hada_t2": "LoHa",
    "lokr_w1": "LoKr",
    "lokr_w1_a": "LoKr",
    "lokr_w1_b": "LoKr",
    "lokr_w2": "LoKr",
    "lokr_w2_a": "LoKr",
    "lokr_w2_b": "LoKr",
    "lokr_t2": "LoKr",
    "lora_mid": "LoCon with a Tucker core (lora_mid)",
    "lora_embedding_A": "embedding LoRA",
    "lora_embedding_B": "embedding LoRA",
    "ia3_l": "IA3",
    "oft_blocks": "OFT",
    "oft_r": "OFT",
    "w_norm": "norm adapter (w_norm)",
    "b_norm": "norm adapter (b_norm)",
}


class UnsupportedAdapterError(ValueError):
    """An adapter uses a variant this merge cannot reproduce; the message names the key."""


def refuse_unsupported(path: str, key: str) -> None:
    """Raise :class:`UnsupportedAdapterError` when ``key`` belongs to an unsupported variant."""
    for part in key.split(".")[-2:]:  # the variant's marker is the key's suffix
        variant = _UNSUPPORTED.get(part)
        if variant is not None:
            raise UnsupportedAdapterError(
                f"{path}: key {key!r} belongs to a {variant} adapter, which lora_cache does not "
                "merge (its weights are not W + scale * B @ A); convert it to plain LoRA or apply "
                "it at run time instead"
            )


def lora_scale(strength: float, alpha: float | None, rank: int, rslora: bool = False) -> float:
    """Return the factor of ``up @ down``: strength x alpha / rank (or / sqrt(rank) for rsLoRA).

    ``alpha`` defaults to the rank, so an adapter that stores none is scaled by its strength.
    """
    if rank <= 0:
        raise ValueError(f"LoRA rank must be positive, got {rank}")
    alpha = float(rank) if alpha is None else float(alpha)
    return float(strength) * alpha / (math.sqrt(rank) if rslora else rank)


@dataclass(frozen=True)
class Delta:
    """One adapter's change to one parameter: ``scale * up @ down`` and/or ``diff_scale * diff``.

    ``up`` is (out, rank) or (out, rank, 1, 1); ``down`` is (rank, in) or (rank, in, kh, kw).
    ``source`` names the adapter file and key for error messages.
    """

    source: str
    up: torch.Tensor | None = None
    down: torch.Tensor | None = None
    scale: float = 1.0
    diff: torch.Tensor | None = None
    diff_scale: float = 1.0

    def check(self) -> None:
        """Refuse what ``up @ down`` cannot express, before any layer is merged."""
        if self.up is not None and self.up.dim() == 4 and tuple(self.up.shape[2:]) != (1, 1):
            raise UnsupportedAdapterError(
                f"{self.source}: conv LoRA with a {tuple(self.up.shape[2:])} up kernel is not "
                "supported (only 1x1 up kernels merge as B @ A)"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the parameter this delta fits."""
        if self.up is not None:
            return (self.up.shape[0], *self.down.shape[1:])
        return tuple(self.diff.shape)


def compute_device() -> torch.device:
    """The device merges run on: the GPU when there is one, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class Scratch:
    """One buffer, reused for every layer of a merge, handed out as views of any dtype.

    A fresh one-layer temporary per layer would be freed after each layer, and the C
    allocator may keep such freed blocks instead of returning them to the kernel;
    reusing one buffer keeps the merge's resident high-water mark one layer wide however
    many layers there are. It only grows, to the largest request; :meth:`release` gives
    it back at the end.
    """

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else compute_device()
        self._bytes = torch.empty(0, dtype=torch.uint8, device=self.device)

    def reserve(self, nbytes: int) -> None:
        """Grow the buffer to ``nbytes`` (call once with the largest layer to avoid regrowth)."""
        if nbytes > self._bytes.numel():
            self._bytes = torch.empty(0, dtype=torch.uint8, device=self.device)  # free the old one first
            self._bytes = torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Return a view of ``shape`` and ``dtype`` over the buffer (its contents are garbage)."""
        nbytes = math.prod(shape) * dtype.itemsize
        self.reserve(nbytes)
        return self._bytes[:nbytes].view(dtype).view(shape)

    @property
    def nbytes(self) -> int:
        return self._bytes.numel()

    def release(self) -> None:
        self._bytes = torch.empty(0, dtype=torch.uint8, device=self.device)


def _as_matrix(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor.to(device=device, dtype=torch.float32).flatten(1)


def _accumulate(acc: torch.Tensor, delta: Delta) -> None:
    """Add one delta to the fp32 accumulator ``acc`` in place."""
    if delta.up is not None:
        delta.check()
        up = _as_matrix(delta.up, acc.device)
        down = _as_matrix(delta.down, acc.device)
        acc.view(acc.shape[0], -1).addmm_(up, down, alpha=delta.scale)
    if delta.diff is not None:
        acc.add_(delta.diff.to(acc.device), alpha=delta.diff_scale)


def merged_weight(
    base: torch.Tensor,
    deltas: list[Delta],
    out: torch.Tensor,
    scratch: Scratch,
    out_ready: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Write ``base + sum(deltas)`` into ``out`` (base's dtype and shape) and return ``out``.

    The sum runs in fp32 on ``scratch``'s device; only the final cast writes ``out``.
    ``out`` may be ``base`` itself (a writable in-place merge): base is fully read into
    the accumulator before ``out`` is written. ``out_ready`` is called between the sum
    and the cast, so a caller can let the previous layer's bytes leave ``out`` (be
    written to disk) while this layer is summed.
    """
    if out.shape != base.shape or out.dtype != base.dtype:
        raise ValueError(f"out is {tuple(out.shape)} {out.dtype}, base is {tuple(base.shape)} {base.dtype}")
    acc = scratch.take(tuple(base.shape), torch.float32)
    acc.copy_(base if base.device == acc.device else base.to(acc.device))
    for delta in deltas:
        _accumulate(acc, delta)
    if out_ready is not None:
        out_ready()
    if acc.device == out.device:
        out.copy_(acc)
    else:
        out.copy_(acc.to(base.dtype))
    return out
