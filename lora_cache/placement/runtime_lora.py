"""Run-time LoRA: a targeted Linear adds ``scale * (x A^T) B^T`` to its output.

The base weight stays what it was (a read-only mapped view of the checkpoint) and is
never written, so applying or removing an adapter this way costs no anonymous memory
beyond the adapter's own factors, and those are views of the adapter file's read-only
mapping whenever their dtype and device already match the layer's. The price is a
little arithmetic on every forward, which is why :mod:`lora_cache.switching.adapter_switch` only
serves this way while the merged combination is being built.

The factors are non-persistent buffers of a child module (``runtime_lora``) of each
targeted Linear: the accountant's ledger sees them (``hostmem.account`` walks buffers),
``model.to(device)`` moves them, and ``state_dict`` never saves them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hostmem.errors import InputError
from hostmem.safetensors.writers import guard_foreign_writers, register_lora_holder
from ..adapters.checks import check_before_use
from ..targets.layer_target import LayerTarget

__all__ = ["CHILD", "RuntimeLoRA", "apply_runtime", "remove_runtime", "runtime_bytes", "unsupported_reason"]

CHILD = "runtime_lora"  # the child module name on each targeted Linear


def unsupported_reason(target: LayerTarget) -> str | None:
    """Why ``target`` cannot be applied at run time (None when it can).

    A Linear's weight takes LoRA pairs and full deltas, its bias full deltas; anything
    else (a conv kernel, a bare parameter of a custom module, a LoHa or LoKr term) is only
    ever merged.
    """
    if not isinstance(target.module, nn.Linear):
        return f"{target.name!r} belongs to a {type(target.module).__name__}, not an nn.Linear"
    if target.attr == "weight":
        dora = [d.source for d in target.deltas if d.magnitude is not None]
        if dora:
            return f"{dora[0]}: a DoRA term (its rows are rescaled by the merged weight's norms)"
        factored = [d for d in target.deltas if d.factors is not None]
        if factored:
            return f"{factored[0].source}: a {factored[0].factors.kind} term (its change is no LoRA pair)"
        bad = [d.source for d in target.deltas if d.up is not None and (d.up.dim() != 2 or d.down.dim() != 2)]
        return f"{bad[0]}: not a 2-D LoRA pair" if bad else None
    if target.attr == "bias":
        bad = [d.source for d in target.deltas if d.up is not None]
        return f"{bad[0]}: a LoRA pair on a bias" if bad else None
    return f"{target.name!r} is neither the weight nor the bias of its Linear"


class RuntimeLoRA(nn.Module):
    """The run-time terms of one Linear, summed onto its output by a forward hook.

    Each term is ``(kind, scale)`` with its tensors in buffers ``t{i}_*``: ``pair``
    adds ``scale * (x down^T) up^T``, ``diff`` adds ``scale * x diff^T``, ``bias``
    adds ``scale * diff_b``.
    """

    def __init__(self):
        super().__init__()
        self.terms: list[tuple[str, float]] = []
        self.handle = None

    def add(self, kind: str, scale: float, **tensors: torch.Tensor) -> None:
        index = len(self.terms)
        for role, tensor in tensors.items():
            self.register_buffer(f"t{index}_{role}", tensor, persistent=False)
        self.terms.append((kind, float(scale)))

    def delta(self, x: torch.Tensor) -> torch.Tensor | None:
        """The sum of every term for input ``x`` (None when there is none)."""
        total = None
        for i, (kind, scale) in enumerate(self.terms):
            if kind == "pair":
                term = F.linear(F.linear(x, getattr(self, f"t{i}_down")), getattr(self, f"t{i}_up"))
            elif kind == "diff":
                term = F.linear(x, getattr(self, f"t{i}_diff"))
            else:
                term = getattr(self, f"t{i}_bias")
            term = term * scale
            total = term if total is None else total + term
        return total

    def extra_repr(self) -> str:
        return ", ".join(f"{kind} x{scale:g}" for kind, scale in self.terms)


def _like(tensor: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``tensor`` in the layer's dtype and device: itself (a mapped view) when it already is."""
    return tensor.detach().to(device=weight.device, dtype=weight.dtype)


def _add_terms(lora: RuntimeLoRA, target: LayerTarget, weight: torch.Tensor) -> None:
    for delta in target.deltas:
        if target.attr == "bias":
            lora.add("bias", delta.diff_scale, bias=_like(delta.diff, weight))
            continue
        if delta.up is not None:
            lora.add("pair", delta.scale, down=_like(delta.down, weight), up=_like(delta.up, weight))
        if delta.diff is not None:
            lora.add("diff", delta.diff_scale, diff=_like(delta.diff, weight))


def _hook(module: nn.Module, args, output):
    lora = module._modules.get(CHILD)
    delta = None if lora is None else lora.delta(args[0])
    return output if delta is None else output + delta


def apply_runtime(targets: list[LayerTarget]) -> int:
    """Hook every target's Linear so that it adds its deltas at run time; return the bytes
    of factors that had to be copied (cast or moved), the rest being mapped views.

    Refuses (ValueError naming the parameter) before hooking anything when a target is
    not expressible at run time (see :func:`unsupported_reason`), and (AdapterError
    naming the file and key) when an adapter holds a NaN or an infinite value.
    """
    for target in targets:
        reason = unsupported_reason(target)
        if reason is not None:
            raise InputError(f"cannot apply {reason} at run time")
    check_before_use(d for t in targets for d in t.deltas)
    guard_foreign_writers()  # diffusers' "LoRA off" calls refuse from now on (_holds_terms)
    for target in targets:
        module = target.module
        lora = module._modules.get(CHILD)
        if lora is None:
            lora = RuntimeLoRA()
            module.add_module(CHILD, lora)
            lora.handle = module.register_forward_hook(_hook)
        _add_terms(lora, target, module.weight)
    return runtime_bytes(targets, copied_only=True)


def _modules_of(model) -> list[nn.Module]:
    roots = model.values() if isinstance(model, dict) else [model]
    return [m for root in roots for m in root.modules()]


def _holds_terms(module: nn.Module) -> bool:
    """Whether ``module`` is a Linear with run-time terms, for diffusers' ``disable_lora`` and
    the like to refuse rather than return with the terms still on
    (:func:`hostmem.safetensors.writers.register_lora_holder`)."""
    return CHILD in module._modules


register_lora_holder(_holds_terms)


def remove_runtime(model) -> int:
    """Unhook every run-time LoRA in ``model``; return how many Linears were unhooked."""
    removed = 0
    for module in _modules_of(model):
        lora = module._modules.get(CHILD)
        if isinstance(lora, RuntimeLoRA):
            lora.handle.remove()
            del module._modules[CHILD]
            removed += 1
    return removed


def runtime_bytes(model_or_targets, copied_only: bool = False) -> int:
    """Bytes of run-time LoRA factors held by ``model`` (or by ``targets``' Linears).

    ``copied_only`` counts only those that are not views of an adapter file's mapping
    (cast or moved: anonymous memory, or device memory).
    """
    if isinstance(model_or_targets, list):
        modules = {id(t.module): t.module for t in model_or_targets}.values()
    else:
        modules = _modules_of(model_or_targets)
    seen, total = set(), 0
    for module in modules:
        lora = module._modules.get(CHILD)
        if not isinstance(lora, RuntimeLoRA):
            continue
        for buffer in lora.buffers():
            key = (buffer.data_ptr(), buffer.numel() * buffer.element_size())
            if key in seen or (copied_only and _is_mapped_view(buffer)):
                continue
            seen.add(key)
            total += buffer.numel() * buffer.element_size()
    return total


def _is_mapped_view(tensor: torch.Tensor) -> bool:
    """True for a CPU tensor over a buffer it does not own (the adapter file's mapping)."""
    return tensor.device.type == "cpu" and not tensor.untyped_storage().resizable()
