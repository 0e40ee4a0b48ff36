"""What the device path asks of a forward: no gradients, and its turn given back however it is left.

On the device path a moved layer computes from a slot of :mod:`.device_copy` that the
next load refills, and passes of one component take turns (:mod:`.run`). Two things
follow:

- it serves inference only: a component's forward with grad enabled runs as under
  ``torch.no_grad()`` (weights that require grad, as ``from_pretrained`` leaves them, are
  no wish for gradients; its output requires none, so a backward says so rather than
  giving the weights outside the layers gradients and the moved ones none), and one
  whose input requires grad (a gradient with respect to the input) is refused, naming
  what to run under: it would be computed with weights a backward finds overwritten;
- the turn a pass takes in the component's forward pre-hook is given back in a forward
  hook that torch runs for an ``Exception`` only (``always_call``), so the component's
  ``forward`` is wrapped for the run: a pass left by a ``KeyboardInterrupt`` (Ctrl+C in a
  notebook server) or another ``BaseException`` gives its turn back too, instead of
  leaving the next pass from any other thread waiting for it for good.
"""

from __future__ import annotations

from typing import Callable

import torch

from hostmem.errors import InputError
from hostmem.forward_exit import wrap_forward

__all__ = ["guard_forward", "refuse_grad"]


def refuse_grad(component: str, layer: str, args, kwargs) -> None:
    """Raise where layer ``layer``'s forward would record a graph: grad enabled and an input
    that requires grad (a component's own forward runs without gradients, see
    :func:`guard_forward`, so only an input can ask for them)."""
    if torch.is_grad_enabled() and _wants_grad(args, kwargs):
        raise InputError(f"{component}.{layer}: a forward with gradients on the device path (its input requires "
                         "grad); the device path serves inference only (a layer's weights stand in from a buffer "
                         "refilled before a backward could read them): run the model under torch.no_grad() or "
                         "torch.inference_mode(), or without device= (the host path keeps gradients)")


def _wants_grad(args, kwargs) -> bool:
    """Whether any tensor among the arguments, in lists, tuples and dicts too (SDXL's
    ``added_cond_kwargs``), requires grad."""
    seen, todo = 0, [*args, *kwargs.values()]
    while todo and seen < 10_000:
        item, seen = todo.pop(), seen + 1
        if isinstance(item, torch.Tensor):
            if item.requires_grad:
                return True
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
        elif isinstance(item, dict):
            todo.extend(item.values())
    return False


def guard_forward(root: torch.nn.Module, left: Callable[[], None]) -> Callable[[], None]:
    """Wrap ``root.forward`` so that it runs without gradients unless an input asks for
    them, and ``left()`` runs when it is left by a ``BaseException`` that is no
    ``Exception`` (:func:`hostmem.forward_exit.wrap_forward`); returns what sets the
    forward back."""
    return wrap_forward(root, left, _run)


def _run(inner, args, kwargs):
    if torch.is_grad_enabled() and not _wants_grad(args, kwargs):
        with torch.no_grad():
            return inner(*args, **kwargs)
    return inner(*args, **kwargs)
