"""A module's forward left by an interrupt, told to whoever holds a turn across it.

Torch runs a forward hook registered with ``always_call=True`` when the forward raises an
``Exception``, not when it is left by a ``KeyboardInterrupt`` (Ctrl+C in a notebook
server), a ``SystemExit`` or another ``BaseException``. Whatever a pre-hook takes for the
length of a forward (a reader's place in a gate, a turn on a device's slots) and gives
back in such a hook would stay taken, and the next caller from any other thread would
wait for it for good. :func:`wrap_forward` closes that gap for one module's forward.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

__all__ = ["wrap_forward"]


def wrap_forward(root: nn.Module, left: Callable[[], None], call: Callable | None = None) -> Callable[[], None]:
    """Wrap ``root.forward`` so that ``left()`` runs when it is left by a ``BaseException``
    that is no ``Exception``; ``call(inner, args, kwargs)`` runs the wrapped forward
    (default: ``inner(*args, **kwargs)``). Returns what sets the forward back (unless it was
    replaced since: a wrapper of another library's put over it stays)."""
    own = root.__dict__.get("forward")  # an instance's own forward, set back as it was
    inner = root.forward

    def forward(*args, **kwargs):
        try:
            return inner(*args, **kwargs) if call is None else call(inner, args, kwargs)
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
