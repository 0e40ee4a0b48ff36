"""What the device path asks of a forward: no gradients, and its turn given back however it is left.

On the device path a moved layer computes from a slot of :mod:`.device_copy` that the
next load refills, and passes of one component take turns (:mod:`.run`). Two things
follow:

- it serves inference only: a forward that would record a graph through a moved layer
  (grad enabled, and an input or a weight that requires grad) is refused, naming what to
  run under, never computed with weights a backward would find overwritten;
- the turn a pass takes in the component's forward pre-hook is given back in a forward
  hook that torch runs for an ``Exception`` only (``always_call``), so the component's
  ``forward`` is wrapped for the run: a pass left by a ``KeyboardInterrupt`` (Ctrl+C in a
  notebook server) or another ``BaseException`` gives its turn back too, instead of
  leaving the next pass from any other thread waiting for it for good.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from hostmem.errors import InputError

__all__ = ["guard_forward", "refuse_grad"]


def refuse_grad(component: str, layer: str, module: torch.nn.Module, args, kwargs,
                outside: Iterable[torch.Tensor]) -> None:
    """Raise where layer ``layer``'s forward would record a graph: grad enabled, and an input,
    a weight of ``module`` or one of ``outside`` (the component's tensors placed on the
    device) that requires grad."""
    if not torch.is_grad_enabled():
        return
    inputs = any(isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values()))
    held = sum(1 for t in (*module.parameters(), *outside) if t.requires_grad)
    if inputs or held:
        what = "its input requires grad" if inputs else f"{held} of its weights require grad"
        raise InputError(f"{component}.{layer}: a forward with gradients on the device path ({what}); the device "
                         "path serves inference only (a layer's weights stand in from a buffer refilled before a "
                         "backward could read them): run the model under torch.no_grad() or torch.inference_mode(), "
                         "or without device= (the host path keeps gradients)")


def guard_forward(root: torch.nn.Module, left: Callable[[], None]) -> Callable[[], None]:
    """Wrap ``root.forward`` so that ``left()`` runs when the forward is left by a
    ``BaseException`` that is no ``Exception`` (for those torch runs the ``always_call``
    hooks); returns what sets the forward back (unless it was replaced since)."""
    own = root.__dict__.get("forward")  # an instance's own forward, set back as it was
    inner = root.forward

    def forward(*args, **kwargs):
        try:
            return inner(*args, **kwargs)
        except Exception:
            raise
        except BaseException:
            left()
            raise

    root.forward = forward

    def undo() -> None:
        if root.__dict__.get("forward") is forward:
            if own is None:
                del root.forward
            else:
                root.forward = own

    return undo
