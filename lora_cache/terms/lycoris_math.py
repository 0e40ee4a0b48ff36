"""LyCORIS's factored weight changes (LoHa, LoKr, LoCon's Tucker core), one row block at a time.

Their change is no ``up @ down``, so the merge asks each for the rows of a row block
(:meth:`Prepared.add_to`, fp32, the layer's flattened width) and adds them with the
term's scale, in the same blocks and order as every other term
(:func:`lora_cache.compute.merge_math.add_terms`): the in-place path, the cached path and a
tensor-parallel part sum the same numbers. A layer's factors are made ready once
(:meth:`Factors.prepared`: fp32 on the compute device, a Tucker core contracted), never
as a whole-layer delta. The definitions, as LyCORIS (``lycoris/functional``) and ComfyUI
(``comfy/weight_adapter``) both give them, each flattened to ``(out, in * kernel)``:

- LoHa: ``(w1_a @ w1_b) * (w2_a @ w2_b)``; with Tucker cores ``t1``, ``t2`` each half is
  ``einsum("i j ..., j r, i p -> p r ...", t, w_b, w_a)`` (``w_a`` then ``(rank, out)``);
- LoKr: ``kron(w1, w2)``, each of ``w1`` / ``w2`` stored whole or as ``_a @ _b``, ``w2``
  possibly through a Tucker core ``t2`` as LoHa's halves are; a conv's ``w1`` gains the
  kernel's unit axes, so row ``p`` of the flattened product is ``w1[p // b]`` (x) ``w2[p % b]``;
- LoCon with a Tucker core: ``up @ einsum("i j ..., j n -> i n ...", mid, down)``.

The scale (alpha / rank, and the strength) is the term's, decided where the file is read
(:mod:`lora_cache.adapters.lycoris_parts`). A placement may take some rows of the change
(a split over separate projections) and land on some rows of a fused weight: the rows
outside read as zeros.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

__all__ = ["KINDS", "LOHA", "LOKR", "TUCKER", "Factors", "Prepared"]

LOHA, LOKR, TUCKER, DENSE = "LoHa", "LoKr", "LoCon with a Tucker core", "dense"
KINDS = (LOHA, LOKR, TUCKER)


def _flat(tensor: torch.Tensor, device) -> torch.Tensor:
    return tensor.to(device=device, dtype=torch.float32).reshape(tensor.shape[0], -1)


def _tucker(core: torch.Tensor, side_b: torch.Tensor, device) -> torch.Tensor:
    """``core`` contracted with ``side_b`` on its second index: ``(rank, in * kernel)``."""
    core = core.to(device=device, dtype=torch.float32)
    return torch.einsum("i j ..., j n -> i n ...", core, side_b.to(device=device, dtype=torch.float32)).flatten(1)


@dataclass(frozen=True)
class Factors:
    """One factored change as the file stores it (views of its mapping, nothing read), and
    where it lands: ``shape`` is the weight's, ``rows_from`` the first row of the change
    this placement takes, ``span`` the rows of the weight it lands on (None: all)."""

    kind: str
    parts: tuple[tuple[str, torch.Tensor], ...]  # (role, tensor), the roles of lycoris_parts
    shape: tuple[int, ...]
    rows_from: int = 0
    span: tuple[int, int] | None = None

    def part(self, role: str) -> torch.Tensor | None:
        return dict(self.parts).get(role)

    def tensors(self) -> list[torch.Tensor]:
        return [tensor for _, tensor in self.parts]

    def placed(self, rows_from: int, span: tuple[int, int] | None, shape: tuple[int, ...]) -> "Factors":
        return replace(self, rows_from=rows_from, span=span, shape=tuple(shape))

    def prepared(self, device) -> "Prepared":
        """The factors in fp32 on ``device``, as the row blocks need them (a layer's once)."""
        p = self.part
        if self.kind == DENSE:
            pairs = (p("matrix").to(device=device, dtype=torch.float32),)
        elif self.kind == TUCKER:
            pairs = (_flat(p("up"), device), _tucker(p("mid"), _flat(p("down"), device), device))
        elif self.kind == LOHA:
            pairs = (*self._loha_half(1, device), *self._loha_half(2, device))
        else:
            pairs = (self._lokr_w1(device), self._lokr_w2(device))
        span = self.span or (0, self.shape[0])
        return Prepared(self.kind, pairs, self.shape, self.rows_from, span)

    def _loha_half(self, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows factor (out, rank), columns factor (rank, in * kernel))`` of half ``n``."""
        a, b, core = self.part(f"hada_w{n}_a"), self.part(f"hada_w{n}_b"), self.part(f"hada_t{n}")
        if core is None:
            return _flat(a, device), _flat(b, device)
        return _flat(a, device).T, _tucker(core, _flat(b, device), device)

    def _lokr_w1(self, device) -> torch.Tensor:
        w1 = self.part("lokr_w1")
        return _flat(w1, device) if w1 is not None else _flat(self.part("lokr_w1_a"), device) @ _flat(
            self.part("lokr_w1_b"), device)

    def _lokr_w2(self, device) -> torch.Tensor:
        w2, core = self.part("lokr_w2"), self.part("lokr_t2")
        if w2 is not None:
            return _flat(w2, device)
        a, b = _flat(self.part("lokr_w2_a"), device), _flat(self.part("lokr_w2_b"), device)
        return a @ b if core is None else a.T @ _tucker(core, b, device)

    def sampled(self, rows: slice, cols: slice) -> "Factors":
        """The change on some rows and columns of its weight, computed (a rounding measure's sample)."""
        matrix = self.prepared(torch.device("cpu")).block(rows)[:, cols]
        return Factors(DENSE, (("matrix", matrix),), tuple(matrix.shape))


@dataclass(frozen=True)
class Prepared:
    """A layer's factors made ready (:meth:`Factors.prepared`); :meth:`block` gives rows of the change."""

    kind: str
    factors: tuple[torch.Tensor, ...]
    shape: tuple[int, ...]
    rows_from: int
    span: tuple[int, int]

    @property
    def width(self) -> int:
        return math.prod(self.shape[1:])

    def block(self, rows: slice) -> torch.Tensor:
        """Rows ``rows`` of the weight's change, fp32 ``(rows, width)``: zeros outside the span."""
        start, stop, step = rows.indices(self.shape[0])
        wanted = torch.arange(start, stop, step, device=self.factors[0].device)
        low, high = self.span
        inside = (wanted >= low) & (wanted < high)
        out = torch.zeros(len(wanted), self.width, dtype=torch.float32, device=wanted.device)
        if bool(inside.any()):
            out[inside] = self._added(wanted[inside] - low + self.rows_from)
        return out

    def add_to(self, flat: torch.Tensor, rows: slice, scale: float) -> None:
        """``flat`` (the block of ``rows``, fp32, 2-D) += ``scale`` times its rows of the change."""
        start, stop, step = rows.indices(self.shape[0])
        low, high = self.span
        if step == 1 and low <= start and stop <= high:  # the common case: no gather, no temporary block
            self._add_rows(flat, slice(start - low + self.rows_from, stop - low + self.rows_from), scale)
        else:
            flat.add_(self.block(rows), alpha=scale)

    def _added(self, index: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(len(index), self.width, dtype=torch.float32, device=self.factors[0].device)
        self._add_rows(out, index, 1.0)
        return out

    def _add_rows(self, flat: torch.Tensor, index, scale: float) -> None:
        """``flat += scale * `` the change's rows ``index`` (a slice, or a tensor of row numbers)."""
        f = self.factors

        def take(tensor):
            return tensor[index] if isinstance(index, slice) else tensor.index_select(0, index)

        if self.kind == DENSE:
            flat.add_(take(f[0]), alpha=scale)
        elif self.kind == TUCKER:
            flat.addmm_(take(f[0]), f[1], alpha=scale)
        elif self.kind == LOHA:
            flat.addcmul_(take(f[0]) @ f[1], take(f[2]) @ f[3], value=scale)
        else:  # LoKr: row p is w1[p // b] (x) w2[p % b]
            w1, w2 = f
            rows = torch.arange(index.start, index.stop, device=w1.device) if isinstance(index, slice) else index
            left, right = w1.index_select(0, rows // w2.shape[0]), w2.index_select(0, rows % w2.shape[0])
            flat.view(flat.shape[0], left.shape[1], -1).addcmul_(left.unsqueeze(2), right.unsqueeze(1), value=scale)
