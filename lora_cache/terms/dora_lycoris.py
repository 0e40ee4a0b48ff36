"""LyCORIS's DoRA (a LoRA pair with a ``dora_scale``) merged as ComfyUI merges it.

LyCORIS stores the magnitude as ``dora_scale`` and says by its shape which axis is
normed: ``(out, 1)`` (``wd_on_out``: each output row) or ``(1, in)`` (each input
column; for a conv, each input channel over its kernel). ComfyUI
(``comfy/weight_adapter/base.py``, ``weight_decompose``) merges a module with previous
weight ``P``, update ``C = P + alpha / rank * up @ down`` and strength ``s`` as::

    D = C * dora_scale / (norm + eps)        eps: float32's, the merge's dtype
    W = P + s * (D - P)                      (W = D at strength 1)

where ``norm`` is, on the column axis, each input column's norm of ``C`` over all rows
(channels of a conv over kernel and rows) and, on the row axis, each row's norm of ``P``.
The row axis differs from LyCORIS's own trainer (which norms ``C``) and from peft's
DoRA; ComfyUI is followed because the house serves what ComfyUI serves for a file of
its layout, and the difference is stated in docs/adapter-formats.md. peft's DoRA (its
``lora_magnitude_vector``, strength inside the scale) is :mod:`lora_cache.compute.merge_math`'s.

The column axis needs the whole layer's column norms before any row block is merged:
:func:`column_scale` turns the sums of squares a first pass gathers into each flattened
column's factor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["COLUMNS", "EPS", "PEFT", "ROWS", "add_decomposed", "axis_of", "column_scale", "peft_dora_after_others"]

PEFT = "peft"  # peft's DoRA: lora_magnitude_vector, rows of W + s B A, strength inside s
ROWS = "comfyui-rows"  # dora_scale (out, 1): rows of the weight before the term
COLUMNS = "comfyui-columns"  # dora_scale (1, in): input columns of the updated weight
EPS = float(torch.finfo(torch.float32).eps)


def peft_dora_after_others(terms) -> bool:
    """Whether a peft DoRA term follows another term of its layer (``terms``: a layer's deltas
    or terms, in order): its norm is then the base's plus its own change alone, not the
    weight the terms before it made (:func:`lora_cache.compute.merge_math.add_terms`; the
    key says so, :mod:`lora_cache.key.combination`)."""
    return any(getattr(t, "magnitude", None) is not None and getattr(t, "dora", None) == PEFT
               for t in list(terms)[1:])


def axis_of(dora_scale: torch.Tensor, rows: int) -> str:
    """ComfyUI's rule: the row axis where ``dora_scale``'s first size is the weight's rows."""
    return ROWS if dora_scale.shape[0] == rows else COLUMNS


def column_scale(sumsq: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """Each flattened column's factor ``magnitude / (norm + eps)``: ``sumsq`` holds the sums
    of squares of the updated weight's flattened columns, ``magnitude`` one value per input
    channel (a conv's channel spans its kernel's columns)."""
    channels = magnitude.numel()
    group = sumsq.numel() // channels
    norms = sumsq.view(channels, group).sum(dim=1).sqrt() + EPS
    return (magnitude.flatten().to(sumsq) / norms).repeat_interleave(group)


def add_decomposed(flat: torch.Tensor, add_term: Callable[[torch.Tensor], None], strength: float,
                   row_magnitude: torch.Tensor | None, columns: torch.Tensor | None) -> None:
    """``flat`` (a row block, fp32, 2-D) becomes ``P + s * (D - P)`` (see the module);
    ``add_term(flat)`` adds the block's rows of the scaled term (a LoRA pair's ``up @ down``,
    or a LoHa's or LoKr's change: :mod:`lora_cache.terms.lycoris_math`); ``row_magnitude`` the
    block's values on the row axis, else ``columns`` the layer's column factors
    (:func:`column_scale`)."""
    before = flat.clone()
    add_term(flat)
    if row_magnitude is not None:
        flat.mul_((row_magnitude / (torch.linalg.vector_norm(before, dim=1) + EPS)).unsqueeze(1))
    else:
        flat.mul_(columns.unsqueeze(0))
    if strength != 1.0:
        flat.sub_(before).mul_(strength).add_(before)
