"""Pin execution: apply a pin plan to loaded components, then check it with /proc.

Each planned layer is pinned in place (``hostmem.pinning``: cudaHostRegister on a CUDA
host, mlock on a CPU host), never more than the plan names. Afterwards the
accountant must find exactly the planned bytes of those layers pinned, and on a
CPU host the kernel must hold exactly the whole pages asked for locked (``VmFlags lo``
in ``/proc/self/smaps`` under each span: the bytes actually locked, not the tensors'
sizes, and unmoved by what the rest of the process locks or unlocks meanwhile, such
as earlier pins a garbage collection lets go). A mismatch undoes this call's pins and
raises :class:`PinMismatch`.

Net cost: a layer mapped from the checkpoint is pinned where it lies, so its page
cache becomes the pinned copy and nothing is duplicated (``/proc/meminfo``: Mlocked
grows by the layer, Cached does not). Were a pin made as a copy instead, the
original's page cache would be released with ``hostmem.pinning.drop_page_cache``.

Pins follow their weights. Whatever replaces a pinned parameter afterwards (a LoRA
merge or switch, an unmerge, a remap or spill) tells the pinner
(:func:`hostmem.pinning.replaced`), which pins the replacement in place while the plan
still pins that layer and the pages locked stay within the plan's pin budget, and
otherwise releases the layer (``AppliedPins.released``). :meth:`AppliedPins.check`
says, at any time, whether the pinner's books, the kernel and the ledger agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch

import hostmem
from hostmem.errors import HostmemError, InputError
from hostmem.pinning import Pinner, page_bytes
from hostmem.procfs import locked_within, read_status

from .config import DeploymentConfig
from .deployment import DeploymentPlan
from .sizes import REST, from_ledger, layer_matcher

__all__ = ["ComponentPins", "AppliedPins", "PinCheck", "PinMismatch", "layer_tensors", "apply_pin_plan"]


class PinMismatch(HostmemError, RuntimeError):
    """What was pinned is not what the plan says; the message gives both."""


@dataclass(frozen=True)
class ComponentPins:
    component: str
    layers: tuple[str, ...]
    planned_bytes: int  # the layers' bytes, as planned
    accounted_bytes: int  # what the accountant finds pinned in those layers afterwards


@dataclass(frozen=True)
class AppliedPins:
    """The pins of one :func:`apply_pin_plan` call; keep it (and its pinner) while serving."""

    backend: str
    components: tuple[ComponentPins, ...]
    locked_bytes: int  # whole pages this call locked
    vm_lck_before: int
    vm_lck_after: int
    pinner: Pinner = field(compare=False, repr=False)
    locked_before: int = 0  # what the pinner held before this call

    @property
    def planned_bytes(self) -> int:
        return sum(c.planned_bytes for c in self.components)

    @property
    def locked_now(self) -> int:
        """Whole pages this call's pins hold now, after whatever replaced their weights."""
        return self.pinner.locked_bytes - self.locked_before

    @property
    def released(self) -> list:
        """``(component, layer)`` keys let go because a replacement could not be pinned."""
        return list(self.pinner.released)

    def check(self, modules: Mapping[str, torch.nn.Module]) -> "PinCheck":
        """The pinner's books, the kernel and the ledger, read now; :class:`PinMismatch` if they differ."""
        kernel = locked_within(self.pinner.spans()) - self.locked_before
        found = PinCheck(self.locked_now, kernel, ledger_pinned_pages(modules))
        if self.backend == "mlock" and not found.agree:
            raise PinMismatch(f"pins no longer agree: {found}")
        return found

    def release(self) -> int:
        """Unpin everything this pinner holds; return the bytes released."""
        return self.pinner.unpin_all()


@dataclass(frozen=True)
class PinCheck:
    """Pinned bytes by three witnesses: the pinner's books, the kernel (bytes under the
    pinner's spans that smaps shows locked, beyond what it held before the pins were
    applied) and the ledger (whole pages under the storages it finds pinned)."""

    books: int
    kernel: int
    ledger: int

    @property
    def agree(self) -> bool:
        return self.books == self.kernel == self.ledger


def ledger_pinned_pages(modules: Mapping[str, torch.nn.Module]) -> int:
    """Whole pages under the storages :func:`hostmem.account` finds wholly pinned."""
    ledger = hostmem.account(dict(modules))
    pinned = []
    for name, module in modules.items():
        tensors = dict(module.named_parameters(remove_duplicate=False))
        tensors.update(module.named_buffers(remove_duplicate=False))
        entries = ledger.components[name].parameters.values()
        pinned += [tensors[e.name] for e in entries if e.nbytes and e.residency.pinned == e.nbytes]
    return page_bytes(pinned)


def layer_tensors(module: torch.nn.Module, pattern: str | None) -> dict[str, list[torch.Tensor]]:
    """Tensors of ``module`` by layer, one per storage, named as the accountant names them."""
    match = layer_matcher(pattern) if pattern else (lambda name: None)
    seen: set[tuple[int, int]] = set()
    out: dict[str, list[torch.Tensor]] = {}
    named = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    for name, tensor in named:
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key in seen:
            continue
        seen.add(key)
        found = match(name)
        out.setdefault(REST if found is None else found[1], []).append(tensor)
    return out


def _planned_tensors(plan: DeploymentPlan, modules, config) -> dict[tuple[str, str], list[torch.Tensor]]:
    """``{(component, layer): tensors}`` of every layer the plan pins and that is not pinned yet."""
    out = {}
    for name, pins in plan.pins.plans.items():
        if not pins.pinned_layers:
            continue
        if name not in modules:
            raise InputError(f"the plan pins layers of {name!r}, but no module of that name was given")
        units = {u.name: u for u in plan.components[name].units}
        groups = layer_tensors(modules[name], config.components[name].layer_pattern)
        for layer in pins.pinned_layers:
            tensors = groups.get(layer)
            if tensors is None or layer not in units:
                raise InputError(
                    f"{name}: the plan pins {layer!r}, which the loaded module does not have; a plan made from "
                    "declared sizes or another checkpoint cannot be applied: plan again with plan_loaded"
                )
            actual = sum(t.untyped_storage().nbytes() for t in tensors)
            if actual != units[layer].nbytes:
                raise InputError(
                    f"{name}.{layer}: the plan has {units[layer].nbytes} bytes, the module {actual}; "
                    "plan again after loading (plan_loaded)"
                )
            if units[layer].residency.pinned < units[layer].nbytes:
                out[(name, layer)] = tensors
    return out


def apply_pin_plan(
    plan: DeploymentPlan,
    modules: Mapping[str, torch.nn.Module],
    config: DeploymentConfig,
    pinner: Pinner | None = None,
) -> AppliedPins:
    """Pin the plan's layers of ``modules`` in place and check the result (see the module doc)."""
    pinner = pinner if pinner is not None else Pinner()
    planned = _planned_tensors(plan, modules, config)
    expected_locked = pinner.would_lock([t for ts in planned.values() for t in ts])
    vm_before, locked_before = read_status().vm_lck, pinner.locked_bytes
    _follow_the_plan(pinner, plan, locked_before + max(plan.pins.budget_bytes, expected_locked))
    done = []
    try:
        for key, tensors in planned.items():
            pinner.pin(key, tensors)
            done.append(key)
        result = _verify(plan, modules, config, pinner, done, vm_before, locked_before, expected_locked)
    except BaseException:
        for key in reversed(done):
            pinner.unpin(key)
        raise
    return result


def _follow_the_plan(pinner: Pinner, plan: DeploymentPlan, max_locked: int) -> None:
    """Let the pinner move a layer's pins to its replacement while ``plan`` pins that layer,
    within the plan's pin budget (a caller's own policy and cap stand)."""
    if pinner.wants is None:
        plans = plan.pins.plans
        pinner.wants = lambda key: key[0] in plans and key[1] in plans[key[0]].pinned_layers
    if pinner.max_locked is None:
        pinner.max_locked = max_locked


def _verify(plan, modules, config, pinner, keys, vm_before, locked_before, expected_locked) -> AppliedPins:
    ledger = hostmem.account(dict(modules))
    checks = []
    for name, pins in plan.pins.plans.items():
        if not pins.pinned_layers:
            continue
        cfg = config.components[name]
        sizes = from_ledger(ledger.components[name], cfg.offload, cfg.layer_pattern)
        chosen = set(pins.pinned_layers)
        accounted = sum(u.residency.pinned for u in sizes.units if u.name in chosen)
        checks.append(ComponentPins(name, pins.pinned_layers, pins.pinned_bytes, accounted))
        if accounted != pins.pinned_bytes:
            raise PinMismatch(
                f"{name}: planned {pins.pinned_bytes} bytes pinned, the accountant finds {accounted} "
                f"({pinner.backend.name} backend)"
            )
    locked = pinner.locked_bytes - locked_before
    vm_after = read_status().vm_lck
    if locked != expected_locked:
        raise PinMismatch(f"locked {locked} bytes where the plan's pages come to {expected_locked}")
    if pinner.backend.name == "mlock" and (kernel := locked_within(pinner.spans(keys))) != locked:
        raise PinMismatch(
            f"the kernel holds {kernel} of the {locked} bytes this call locked (/proc/self/smaps, VmFlags lo): "
            "another thread unlocked some of them meanwhile"
        )
    return AppliedPins(pinner.backend.name, tuple(checks), locked, vm_before, vm_after, pinner, locked_before)
