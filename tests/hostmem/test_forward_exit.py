"""A module's forward wrapped so that an interrupt gives back what a pre-hook took.

The wrapper keeps the forward's signature (diffusers picks the arguments it passes by
``inspect.signature``), runs ``left`` for a ``KeyboardInterrupt`` and not for an
``Exception`` (torch's ``always_call`` hooks see those), is found again under another
library's wrapper, and once undone under such a wrapper only passes calls through."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from torch import nn

from hostmem.forward_exit import is_wrapped, wrap_forward


class Decoder(nn.Module):
    def forward(self, sample: torch.Tensor, num_frames: int = 1, fail: type | None = None):
        if fail is not None:
            raise fail()
        return sample * num_frames


def _hook_of_another_library(module: nn.Module) -> None:
    """What diffusers' and accelerate's hooks do: a new forward over the one they found."""
    old = module.forward
    module.forward = functools.update_wrapper(functools.partial(lambda m, *a, **k: old(*a, **k), module), old)


def test_the_wrapper_keeps_the_signature_diffusers_reads():
    module, left = Decoder(), []
    wrap_forward(module, lambda: left.append(1))
    assert "num_frames" in inspect.signature(module.forward).parameters
    assert torch.equal(module(torch.ones(2), num_frames=3), torch.full((2,), 3.0))


def test_an_interrupt_runs_left_once_and_an_exception_does_not():
    module, left = Decoder(), []
    wrap_forward(module, lambda: left.append(1))
    with pytest.raises(ValueError):
        module(torch.ones(1), fail=ValueError)
    assert left == []
    with pytest.raises(KeyboardInterrupt):
        module(torch.ones(1), fail=KeyboardInterrupt)
    assert left == [1]


def test_found_under_another_wrapper_and_only_passing_through_once_undone():
    module, left = Decoder(), []
    mark = lambda: left.append(1)  # noqa: E731
    undo = wrap_forward(module, mark)
    _hook_of_another_library(module)
    assert is_wrapped(module, mark)
    assert not is_wrapped(Decoder(), mark)
    undo()  # the other wrapper stays over ours: ours can no longer be taken off, so it stands aside
    assert not is_wrapped(module, mark)
    with pytest.raises(KeyboardInterrupt):
        module(torch.ones(1), fail=KeyboardInterrupt)
    assert left == []
    bare = Decoder()
    wrap_forward(bare, mark)()
    assert "forward" not in bare.__dict__  # undone on top: the class's forward again
