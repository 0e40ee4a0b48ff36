"""The accountant: where each parameter's host bytes live, as a Ledger.

:func:`account` walks one module or a dict of named components, parameters and
buffers, counts a storage that several tensors share once (tied weights, views), and
classifies every storage's bytes with the residency classifier. The Ledger also keeps
the process's own figures, so that anonymous memory no parameter explains
("unattributed": activations, allocator caches, a leaked copy) is visible too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping

import torch

from .procfs import ProcStatus, read_status
from .residency import RangeClassifier, Residency
from .table import format_table
from .units import format_size

__all__ = ["ParameterEntry", "ComponentLedger", "Ledger", "account"]


@dataclass(frozen=True)
class ParameterEntry:
    """One storage's residency, under the first name it was seen by."""

    name: str
    nbytes: int
    dtype: str
    residency: Residency
    shared_with: tuple[str, ...] = ()
    device: str = "cpu"


@dataclass(frozen=True)
class ComponentLedger:
    """All host storages of one component (a DiT, a text encoder)."""

    name: str
    parameters: dict[str, ParameterEntry]
    device_bytes: int = 0

    @property
    def totals(self) -> Residency:
        total = Residency()
        for entry in self.parameters.values():
            total = total + entry.residency
        return total


@dataclass(frozen=True)
class Ledger:
    """Components -> parameters -> residency, plus the process's own figures."""

    pid: int
    components: dict[str, ComponentLedger]
    process: ProcStatus
    extras: dict = field(default_factory=dict)

    @property
    def totals(self) -> Residency:
        total = Residency()
        for component in self.components.values():
            total = total + component.totals
        return total

    @property
    def unattributed_anonymous(self) -> int:
        """Anonymous bytes of the process that no parameter explains (floored at 0).

        RssAnon also counts pinned pages of anonymous memory (an mlocked heap tensor),
        which the ledger files under ``pinned``: they are explained too.
        """
        totals = self.totals
        return max(0, self.process.rss_anon - totals.anonymous - totals.pinned_anonymous)

    def to_dict(self, parameters: bool = True) -> dict:
        """A JSON-safe dict; every size is bytes."""
        out = {
            "pid": self.pid,
            "totals": self.totals.to_dict(),
            "unattributed_anonymous": self.unattributed_anonymous,
            "process": {
                "rss_anon": self.process.rss_anon,
                "rss_file": self.process.rss_file,
                "rss_shmem": self.process.rss_shmem,
                "vm_lck": self.process.vm_lck,
                "vm_hwm": self.process.vm_hwm,
            },
            "components": {},
        }
        for name, component in self.components.items():
            entry = {"totals": component.totals.to_dict(), "device_bytes": component.device_bytes}
            if parameters:
                entry["parameters"] = {
                    p.name: {
                        "nbytes": p.nbytes,
                        "dtype": p.dtype,
                        "device": p.device,
                        "shared_with": list(p.shared_with),
                        **p.residency.to_dict(),
                    }
                    for p in component.parameters.values()
                }
            out["components"][name] = entry
        return out

    def to_table(self, top: int = 0) -> str:
        """A readable table: one row per component (and its ``top`` largest parameters)."""
        header = ("", "non-recl.", "anonymous", "file-backed", "shmem", "pinned", "not resident")
        rows = [header]

        def row(label: str, r: Residency) -> tuple:
            return (
                label,
                format_size(r.non_reclaimable),
                format_size(r.anonymous),
                format_size(r.file_backed),
                format_size(r.shmem),
                format_size(r.pinned),
                format_size(r.not_resident + r.swapped),
            )

        for name, component in self.components.items():
            rows.append(row(name, component.totals))
            if top:
                biggest = sorted(component.parameters.values(), key=lambda p: -p.nbytes)[:top]
                rows.extend(row(f"  {p.name}", p.residency) for p in biggest)
        rows.append(row("all parameters", self.totals))
        rows.append(("unattributed anonymous", format_size(self.unattributed_anonymous), "", "", "", "", ""))
        return "\n".join(format_table(rows))


def _named_tensors(module: torch.nn.Module):
    """``named_parameters`` then ``named_buffers`` (duplicates kept), in their order, read
    straight from each module's dicts: the generators behind them cost more than the
    rest of the walk on a model of thousands of parameters."""
    modules = [(prefix + "." if prefix else "", m) for prefix, m in module.named_modules(remove_duplicate=False)]
    for attr in ("_parameters", "_buffers"):
        for prefix, m in modules:
            for name, tensor in getattr(m, attr).items():
                if tensor is not None:
                    yield prefix + name, tensor


def _components(model) -> Mapping[str, torch.nn.Module]:
    if isinstance(model, torch.nn.Module):
        return {"model": model}
    if isinstance(model, Mapping):
        bad = [k for k, v in model.items() if not isinstance(v, torch.nn.Module)]
        if bad:
            raise TypeError(f"account(): components {bad} are not torch.nn.Module")
        return model
    components = getattr(model, "components", None)  # a pipeline (diffusers): its module components
    if isinstance(components, Mapping):
        return {k: v for k, v in components.items() if isinstance(v, torch.nn.Module)}
    raise TypeError(f"account() takes a module, a dict of named modules or a pipeline, not {type(model).__name__}")


def _is_pinned(tensor: torch.Tensor) -> bool:
    try:
        return bool(tensor.is_pinned())
    except RuntimeError:  # no accelerator runtime to ask
        return False


def _pinning_possible() -> bool:
    """Whether a CPU tensor can be pinned by an accelerator runtime in this process; where
    none is there (a CPU build, no GPU), asking each of thousands of tensors is skipped."""
    cuda = getattr(torch, "cuda", None)
    return bool(cuda is not None and cuda.is_available())


@dataclass
class _Storage:
    component: str
    names: list[str]
    start: int
    nbytes: int
    dtype: str
    device: str
    pinned: bool


def _unique_storages(components: Mapping[str, torch.nn.Module]) -> list[_Storage]:
    """Every distinct storage reached from the components, with all names it goes by.

    A few microseconds per tensor: the accountant's cost on a model of thousands of
    parameters is mostly this walk, so it asks each tensor only what it must.
    """
    by_key: dict[tuple, _Storage] = {}
    dtype_names: dict[torch.dtype, str] = {}
    ask_pinned = _pinning_possible()
    for comp_name, module in components.items():
        for name, tensor in _named_tensors(module):
            storage = tensor.untyped_storage()
            device = "cpu" if tensor.is_cpu else str(tensor.device)
            # a storage without memory (the meta device's) is told apart by the storage itself
            key = (storage.data_ptr() or (storage._cdata if storage.nbytes() else 0), storage.nbytes(), device)
            found = by_key.get(key)
            if found is not None:
                found.names.append(name)
                continue
            dtype = dtype_names.get(tensor.dtype) or dtype_names.setdefault(
                tensor.dtype, str(tensor.dtype).replace("torch.", ""))
            by_key[key] = _Storage(comp_name, [name], key[0], key[1], dtype, device,
                                   ask_pinned and device == "cpu" and _is_pinned(tensor))
    return list(by_key.values())


def account(model) -> Ledger:
    """Return the Ledger of ``model`` (a module or ``{"dit": m, "text_encoder": m}``).

    The modules live in this process, so this process's /proc is read. Tensors on a
    device other than the CPU are counted in ``device_bytes``, not in host residency.
    A storage that CUDA reports pinned is counted pinned whole. A storage reached from
    two components is counted in the first.
    """
    components = _components(model)
    storages = _unique_storages(components)
    host = [s for s in storages if s.device == "cpu" and s.nbytes and not s.pinned]
    with RangeClassifier() as classifier:
        classified = classifier.classify_many([(s.start, s.start + s.nbytes) for s in host])
    residency_of = dict(zip(map(id, host), classified))
    params: dict[str, dict[str, ParameterEntry]] = {name: {} for name in components}
    device_bytes = {name: 0 for name in components}
    nothing = Residency()
    for s in storages:
        if s.device != "cpu":
            device_bytes[s.component] += s.nbytes
            continue
        residency = Residency(pinned=s.nbytes) if s.pinned else residency_of.get(id(s), nothing)
        params[s.component][s.names[0]] = ParameterEntry(
            s.names[0], s.nbytes, s.dtype, residency, tuple(s.names[1:]), s.device
        )
    return Ledger(
        pid=os.getpid(),
        components={name: ComponentLedger(name, params[name], device_bytes[name]) for name in components},
        process=read_status(),
    )
