"""What :mod:`lora_cache.switching.adapter_switch` keeps of one model it switches: the combination
it serves, the gate its forward calls pass, and a combination served at run time while
its merged layers are built.

A state belongs to one set of root modules (a module, or a pipeline's components), found
again through the hooks on them. A module serves one combination at a time, so two
states never share a module: a switch of a set that takes in another state's modules
whole replaces that state, and one that takes in only some of them is refused
(:func:`states_on` finds them; the caller decides)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from torch import nn

from hostmem.errors import InputError
from hostmem.forward_exit import is_wrapped, wrap_forward
from ..adapters import Adapter, AdapterFile
from ..placement.layers import is_merged
from ..placement.runtime_lora import runtime_bytes
from .forward_gate import ForwardGate
from ..targets.layer_target import LayerTarget, components_of

__all__ = ["Pending", "SwitchState", "attach", "detach", "existing_state", "rewrap", "shared_refusal",
           "state_for_switch", "state_of", "states_on"]


@dataclass(eq=False)
class Pending:
    """A combination served at run time while its merged layers are built."""

    identity: tuple
    specs: list[Adapter]
    files: list[AdapterFile]
    targets: list[LayerTarget]  # the live model's parameters
    stand_ins: list[LayerTarget]  # the same base tensors in modules of their own, for the build
    kernels: object  # the kernel plan the key is made with (lora_cache.kernels)
    lossy: list[LayerTarget] = field(default_factory=list)  # kept at run time: merging rounds them away
    future: Future | None = None
    swap_error: BaseException | None = None

    @property
    def error(self) -> BaseException | None:
        """Why the build or the swap failed (None while it runs, or when it succeeded)."""
        if self.swap_error is not None:
            return self.swap_error
        done = self.future is not None and self.future.done()
        return self.future.exception() if done else None

    @property
    def built(self) -> bool:
        return self.future is not None and self.future.done() and self.error is None


@dataclass(eq=False)
class SwitchState:
    """One model's switching state, shared by the hooks on its root modules."""

    components: dict
    options: dict
    gate: ForwardGate = field(default_factory=ForwardGate)
    identity: tuple = ()
    pending: Pending | None = None
    handles: list = field(default_factory=list)  # what takes its hooks off the root modules

    def covers(self, roots: dict) -> bool:
        """True when every module of ``roots`` is one of this state's."""
        mine = {id(m) for m in self.components.values()}
        return all(id(m) in mine for m in roots.values())

    def within(self, roots: dict) -> bool:
        """True when every module of this state is one of ``roots``."""
        theirs = {id(m) for m in roots.values()}
        return all(id(m) in theirs for m in self.components.values())


def states_on(roots: dict) -> list[SwitchState]:
    """The switch states hooked on any module of ``roots``, each once, in ``roots``' order."""
    found: list[SwitchState] = []
    for root in roots.values():
        for hook in root._forward_pre_hooks.values():
            state = getattr(hook, "state", None)
            if isinstance(state, SwitchState) and all(state is not f for f in found):
                found.append(state)
    return found


def existing_state(model) -> SwitchState | None:
    """The switch state serving ``model``'s modules, or None when :func:`lora_cache.set_adapters` never
    switched them; refused where two states serve them (switched apart)."""
    states = states_on(components_of(model))
    if len(states) > 1:
        names = " and ".join("(" + ", ".join(n or "a module" for n in st.components) + ")" for st in states)
        raise InputError(f"lora_cache: this model's components were switched apart, as {names}; "
                         "ask about each of those models on its own")
    return states[0] if states else None


def state_of(model) -> SwitchState:
    state = existing_state(model)
    if state is None:
        raise InputError("lora_cache.set_adapters has not been called on this model")
    return state


def _holds_adapters(state: SwitchState) -> bool:
    return state.pending is not None or is_merged(state.components) or runtime_bytes(state.components) > 0


def state_for_switch(roots: dict, options: dict) -> tuple[SwitchState, list[SwitchState]]:
    """The state that switches exactly ``roots`` (new and not yet hooked the first time), and
    the states it replaces: those whose modules are all among ``roots`` (a transformer
    switched alone, then its whole pipeline), or that serve nothing. Refused where another
    state serves adapters on some of ``roots`` and on modules beyond them (a text encoder
    two pipelines share): one module cannot serve both pipelines' combinations."""
    states = states_on(roots)
    state = next((st for st in states if st.covers(roots) and st.within(roots)), None)
    if state is None:
        state = SwitchState(dict(roots), options)
    state.options = options
    replaced = [st for st in states if st is not state]
    for other in replaced:
        if not other.within(roots) and _holds_adapters(other):
            raise InputError(shared_refusal("lora_cache.set_adapters", roots, other))
    return state, replaced


def attach(state: SwitchState, enter, leave) -> None:
    """Hook ``state`` on its root modules: ``enter`` before each forward, ``leave`` after,
    however the forward is left (an interrupt too: :mod:`hostmem.forward_exit`)."""
    state.gate.roots = tuple(state.components.values())
    for root in state.components.values():
        state.handles.append(root.register_forward_pre_hook(enter).remove)
        state.handles.append(root.register_forward_hook(leave, always_call=True).remove)
        state.handles.append(wrap_forward(root, state.gate.leave))


def rewrap(state: SwitchState, root: nn.Module) -> None:
    """Wrap ``root``'s forward again where it no longer is (another library's hook, put on
    before the switch and taken off since, set back the forward it found)."""
    if not is_wrapped(root, state.gate.leave):
        state.handles.append(wrap_forward(root, state.gate.leave))


def detach(state: SwitchState) -> None:
    """Take ``state``'s hooks off its root modules."""
    for undo in reversed(state.handles):
        undo()
    state.handles.clear()


def shared_refusal(call: str, roots: dict, state: SwitchState) -> str:
    """Why ``roots`` cannot be switched while ``state`` serves some of their modules and others too."""
    shared = [name or "the model" for name, m in roots.items() if any(m is o for o in state.components.values())]
    others = [name or "a module" for name, m in state.components.items() if not any(m is r for r in roots.values())]
    return (f"{call}: {', '.join(shared)} is switched together with {', '.join(others)} by an earlier "
            f"lora_cache.set_adapters call, and one module serves one combination at a time; switch the "
            f"components that are not shared on their own (lora_cache.set_adapters(pipe.transformer, ...)), "
            f"give each pipeline its own copy of {', '.join(shared)}, or take the other model to the base "
            f"first (set_adapters(other, [], ...))")
