"""What :mod:`lora_cache.switching.adapter_switch` keeps of one model it switches: the combination
it serves, the gate its forward calls pass, and a combination served at run time while
its merged layers are built."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from ..adapters import Adapter, AdapterFile
from .forward_gate import ForwardGate
from ..targets.layer_target import LayerTarget

__all__ = ["Pending", "SwitchState"]


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
