"""A module's forward left by an interrupt, told to whoever holds a turn across it.

Torch runs a forward hook registered with ``always_call=True`` when the forward raises an
``Exception``, not when it is left by a ``KeyboardInterrupt`` (Ctrl+C in a notebook
server), a ``SystemExit`` or another ``BaseException``. Whatever a pre-hook takes for the
length of a forward (a reader's place in a gate, a turn on a device's slots) and gives
back in such a hook would stay taken, and the next caller from any other thread would
wait for it for good. :func:`wrap_forward` closes that gap for one module's forward.

Two windows stay open to a wrapper: an interrupt in a pre-hook (after what it took, before
the forward), and the first call after another library set the forward back to one it
kept from before the wrapper. For those, :func:`forward_calls` tells a waiter whether the
holder is still inside the module's call at all; a waiter asks every :data:`LOOK_S`.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Callable

from torch import nn

__all__ = ["LOOK_S", "forward_calls", "is_wrapped", "wrap_forward"]

LOOK_S = 0.5  # how often a waiter asks whether the holder's call is still under way

_CALL = getattr(getattr(nn.Module, "_call_impl", None), "__code__", None)  # the frame each module call runs in


def forward_calls(thread_id: int, root: nn.Module) -> int | None:
    """How many calls of ``root`` (``root(...)``, hooks and all) are under way in thread
    ``thread_id``: 0 for a thread that is gone; None where this torch's frames cannot tell
    (its module calls run in no frame of their own: a caller then waits as before)."""
    if not _frames_show_calls():
        return None
    frame = sys._getframe(1) if thread_id == threading.get_ident() else sys._current_frames().get(thread_id)
    return _calls_in(frame, root)


def _calls_in(frame, root: nn.Module) -> int:
    calls = 0
    while frame is not None:
        if frame.f_code is _CALL and frame.f_locals.get("self") is root:
            calls += 1
        frame = frame.f_back
    return calls


@functools.lru_cache(maxsize=1)
def _frames_show_calls() -> bool:
    """Whether a module's call shows in its thread's frames here: asked once, of a call whose
    pre-hook counts it."""
    if _CALL is None:
        return False
    probe, seen = nn.Identity(), []
    probe.register_forward_pre_hook(lambda module, args: seen.append(_calls_in(sys._getframe(), module)))
    probe(0)
    return seen == [1]


def wrap_forward(root: nn.Module, left: Callable[[], None], call: Callable | None = None) -> Callable[[], None]:
    """Wrap ``root.forward`` so that ``left()`` runs when it is left by a ``BaseException``
    that is no ``Exception``; ``call(inner, args, kwargs)`` runs the wrapped forward
    (default: ``inner(*args, **kwargs)``). Returns what sets the forward back (unless it was
    replaced since: a wrapper of another library's put over it stays, and ours under it
    then only passes the call through)."""
    own = root.__dict__.get("forward")  # an instance's own forward, set back as it was
    inner = root.forward
    active = [left, True]  # undone: a wrapper another library's hook kept (and may set back) only passes through

    def forward(*args, **kwargs):
        if not active[1]:
            return inner(*args, **kwargs)
        try:
            return inner(*args, **kwargs) if call is None else call(inner, args, kwargs)
        except Exception:
            raise
        except BaseException:
            left()
            raise

    # the forward's own name, docstring and signature: diffusers picks the arguments it
    # passes by inspect.signature (a VAE's decode of num_frames, a modular block's inputs)
    functools.update_wrapper(forward, inner)
    forward._hostmem_exit = active  # shared with the copies of its __dict__ wrappers over it make
    root.forward = forward

    def undo() -> None:
        active[1] = False
        if root.__dict__.get("forward") is forward:
            if own is None:
                del root.forward
            else:
                root.forward = own

    return undo


def is_wrapped(root: nn.Module, left: Callable[[], None]) -> bool:
    """Whether ``root``'s forward still runs through a :func:`wrap_forward` wrapper for
    ``left``, under whatever wrappers of other libraries were put over it since (each
    names what it wraps as ``__wrapped__``, as ``functools.update_wrapper`` leaves it)."""
    forward, seen = root.__dict__.get("forward"), 0
    while forward is not None and seen < 64:
        mark = getattr(forward, "_hostmem_exit", None)
        if mark is not None and mark[0] == left and mark[1]:
            return True
        forward, seen = getattr(forward, "__wrapped__", None), seen + 1
    return False
