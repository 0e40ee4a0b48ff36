"""A forward of a switched model left by Ctrl+C gives its place in the gate back.

Torch runs the hook that ends a forward (``always_call``) for an ``Exception`` only; a
``KeyboardInterrupt`` in a notebook server, between two requests' switches, used to leave
the thread counted inside the forward: its own next switch was refused as "from inside a
forward", and one from any other thread waited for it for good."""

from __future__ import annotations

import threading

import pytest
import torch

import lora_cache
from lora_cache.switching.adapter_switch import serving
from tests.lora_cache.switching.test_runtime_lora import stack_adapter, stack_model

DIM, DEPTH = 64, 3


def _interrupt_once(module: torch.nn.Module):
    """Raise KeyboardInterrupt in ``module``'s next forward, as Ctrl+C lands there."""
    def hook(mod, args):
        handle.remove()
        raise KeyboardInterrupt

    handle = module.register_forward_pre_hook(hook)


def _switched(tmp_path):
    """A model, its cache root, an adapter for it and an input."""
    return (stack_model(tmp_path, DIM, DEPTH), tmp_path / "cache",
            stack_adapter(tmp_path / "a.safetensors", DIM, DEPTH, 1), torch.randn(2, DIM))


def _switches_go_through(model, root, adapter, x, served) -> None:
    """After the interrupt: a switch to the base from another thread, then back from this
    one, each goes through, and the model serves what it served before."""
    done: list = []
    other = threading.Thread(target=lambda: done.append(lora_cache.set_adapters(model, [], cache_root=root)),
                             daemon=True)
    other.start()
    other.join(30)
    assert not other.is_alive(), "a switch from another thread waits for the interrupted forward for good"
    assert done and done[0].mode == "base" and serving(model) == "base"
    result = lora_cache.set_adapters(model, [adapter], cache_root=root, background=False)  # and from this one
    assert result.mode in ("cached", "built")
    torch.testing.assert_close(model(x), served)


@pytest.mark.parametrize("background", [False, True], ids=["merged", "at-run-time"])
def test_an_interrupted_forward_lets_the_next_switch_through_from_any_thread(tmp_path, background):
    model, root, adapter, x = _switched(tmp_path)
    lora_cache.set_adapters(model, [adapter], cache_root=root, background=background)
    served = model(x)
    _interrupt_once(model.layers[1])
    with pytest.raises(KeyboardInterrupt):
        model(x)
    torch.testing.assert_close(model(x), served)  # the same thread serves on (merged by now, or at run time)
    _switches_go_through(model, root, adapter, x, served)


@pytest.mark.parametrize("where", ["pre-hook", "forward set back"])
def test_an_interrupt_no_wrapper_sees_lets_the_next_switch_through_from_any_thread(tmp_path, where):
    """Ctrl+C in a pre-hook that runs after the switch's (its place in the gate taken, the
    forward not begun), or in the first call after another library set the forward back to
    one it kept from before the switch: the switch from another thread, and from this
    one, still goes through."""
    import types

    model, root, adapter, x = _switched(tmp_path)
    lora_cache.set_adapters(model, [adapter], cache_root=root, background=False)
    served = model(x)
    if where == "pre-hook":
        def hook(module, args):
            handle.remove()
            raise KeyboardInterrupt

        handle = model.register_forward_pre_hook(hook)  # after the switch's own
    else:
        model.forward = types.MethodType(type(model).forward, model)  # a library's hook, taken off
        _interrupt_once(model.layers[1])
    with pytest.raises(KeyboardInterrupt):
        model(x)
    _switches_go_through(model, root, adapter, x, served)
