"""One term of the canonical form: an adapter's change to one parameter, with its scale.

Every reader ends here: a LoRA pair, a full diff, a DoRA magnitude, a LyCORIS factored
change (:mod:`lora_cache.terms.lycoris_math`), each a :class:`Delta` whose ``scale`` is
final (strength x alpha / rank, :func:`lora_scale`, made once where the adapter's keys
are laid on the model: :mod:`lora_cache.targets.keys`). The combination's key
(:mod:`lora_cache.key`) covers these terms and the build (:mod:`lora_cache.compute`) sums
them; neither computes a scale again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from hostmem.errors import InputError
from hostmem.units import FLOAT32_MAX

from ..adapters.spec import AdapterError, UnsupportedAdapterError
from .dora_lycoris import COLUMNS, PEFT
from .lycoris_math import Factors

__all__ = ["Delta", "lora_scale"]


def lora_scale(strength: float, alpha: float | None, rank: int, rslora: bool = False) -> float:
    """Return the factor of ``up @ down``: strength x alpha / rank (or / sqrt(rank) for rsLoRA).

    ``alpha`` defaults to the rank, so an adapter that stores none is scaled by its strength.
    """
    if rank <= 0:
        raise InputError(f"LoRA rank must be positive, got {rank}")
    alpha = float(rank) if alpha is None else float(alpha)
    return float(strength) * alpha / (math.sqrt(rank) if rslora else rank)


@dataclass(frozen=True)
class Delta:
    """One adapter's change to one parameter: ``scale * up @ down`` and/or ``diff_scale * diff``.

    ``up`` is (out, rank) or (out, rank, 1, 1); ``down`` is (rank, in) or (rank, in, kh, kw).
    ``magnitude`` (DoRA, shape (out,)): the rows of ``W + scale * up @ down`` are rescaled
    to it (see the module's docstring); ``dora`` says whose DoRA: peft's, or LyCORIS's
    ``dora_scale`` as ComfyUI merges it on its row or column axis, with ``dora_strength``
    (:mod:`lora_cache.terms.dora_lycoris`; ``scale`` is then alpha / rank alone).
    ``factors``: a LyCORIS factored change (LoHa, LoKr, Tucker LoCon) in place of ``up`` and
    ``down``, scaled by ``scale`` (:mod:`lora_cache.terms.lycoris_math`).
    ``source`` names the adapter file and key for error messages; ``values_check`` is the
    file's check of its values, run before they are first consumed
    (:func:`lora_cache.adapters.checks.check_before_use`).
    """

    source: str
    up: torch.Tensor | None = None
    down: torch.Tensor | None = None
    scale: float = 1.0
    diff: torch.Tensor | None = None
    diff_scale: float = 1.0
    values_check: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    magnitude: torch.Tensor | None = None
    dora: str = PEFT
    dora_strength: float = 1.0
    factors: Factors | None = None

    def check(self) -> None:
        """Refuse what ``up @ down`` cannot express, before any layer is merged."""
        for name in ("scale", "diff_scale", "dora_strength"):
            value = getattr(self, name)
            if not abs(value) <= FLOAT32_MAX:  # NaN too
                raise AdapterError(
                    f"{self.source}: its {name.replace('_', ' ')} {value:g} (strength x alpha / rank) is beyond "
                    f"float32's range ({FLOAT32_MAX:.1e}), which the merge computes in; check the strength and the alpha"
                )
        axis = "input columns" if self.dora == COLUMNS else "rows"
        paired = self.up is not None or self.factors is not None
        fits = paired and (self.shape[1] if self.dora == COLUMNS else self.shape[0])
        if self.magnitude is not None and self.magnitude.numel() != fits:
            raise UnsupportedAdapterError(
                f"{self.source}: a DoRA magnitude vector of {self.magnitude.numel()} values does not fit the "
                f"{fits or 'missing'} {axis} of its LoRA pair; the file is damaged"
            )
        if self.up is not None and any(k != 1 for k in self.up.shape[2:]):
            raise UnsupportedAdapterError(
                f"{self.source}: conv LoRA with a {tuple(self.up.shape[2:])} up kernel is not "
                "supported (only 1x1 up kernels merge as B @ A)"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the parameter this delta fits."""
        if self.factors is not None:
            return tuple(self.factors.shape)
        if self.up is not None:
            return (self.up.shape[0], *self.down.shape[1:])
        return tuple(self.diff.shape)
