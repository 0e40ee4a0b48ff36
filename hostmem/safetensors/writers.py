"""Foreign writers: other libraries' calls that write into weights hostmem mapped read-only.

hostmem maps weights ``PROT_READ`` (``load_readonly``, :func:`hostmem.remap`, the LoRA
merge cache) so that a write faults instead of silently turning pages anonymous. Some
well-known library calls write into weights in place: diffusers' ``fuse_lora`` and
``unfuse_lora`` (pipeline and model), peft's ``merge_and_unload``, ``merge_adapter``
and ``unmerge_adapter`` (each ends in ``base_layer.weight.data += delta``). On a
read-only weight each would die of a bare SIGSEGV halfway through, with some layers
written and some not.

So hostmem wraps those entry points, once, in a thin check that runs before the
library does anything: when a weight the call would write (the base weight of every
peft layer it merges or unmerges) is a view of a read-only mapping, it raises
:class:`ReadOnlyWeightsError` naming the weights and the call to use instead. Nothing
has been written then. A write hook on the module or the parameter cannot do this:
peft and diffusers write through ``.data``, which no hook sees, and a per-layer check
in ``merge()`` would fire after earlier layers were already merged. Wrapping the
library's own methods is the one place that sees the whole call before its first
write. ``safe_fusing=True`` / ``safe_merge=True`` are let through: they merge into a
copy (``weight.data = weight.data.clone() + delta``) and never write the mapping.

diffusers' "LoRA off" calls (``unfuse_lora``, ``unload_lora_weights``, ``disable_lora``,
a model's ``unload_lora``) act on peft's layers only: on a model whose LoRA another layer
applied (the LoRA merge cache, merged or at run time), with no peft layer in it, they
would return without a word and leave the LoRA on. That layer registers a probe
(:func:`register_lora_holder`) naming the modules it holds a LoRA in, and such a call
raises :class:`LoraHeldElsewhereError` naming them and the call that takes it off.

``load_lora_weights`` / ``load_lora_adapter`` write nothing (the adapter runs beside
the mapped base at run time, which is exactly how to use a LoRA without merging), so
they are let through on read-only weights, except on a model that already holds a
merge from the LoRA merge cache: stacking a second adapter there goes through
``lora_cache`` so that its unmerge still restores the base.

The wrappers are installed by :func:`guard_foreign_writers`, which hostmem calls
whenever it hands out read-only weights: on libraries already imported at once, and on
the others when they are imported (a post-import hook on ``sys.meta_path``). It also
installs the fatal-signal report of :mod:`hostmem.safetensors.fault_report` for every other writer.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading

import torch

from ..errors import HostmemError
from .fault_report import MAKE_WRITABLE_HINT, install_fault_report
from .header import read_header
from ..slots import MappedAreas, iter_module_slots, model_components

__all__ = [
    "LoraHeldElsewhereError", "ReadOnlyWeightsError", "guard_foreign_writers", "register_lora_holder",
    "tuner_layers", "read_only_weights", "make_writable", "MERGE_CACHE_FORMAT",
]

# The header ``format`` of the LoRA merge cache's layer files starts with this (the cache
# writes it; hostmem reads only the header, so a merged weight is told from a base weight).
MERGE_CACHE_FORMAT = "hostmem-lora-merge-cache"

_WRITES, _SAFE_WRITES, _STACKS, _OFF = "writes", "safe-writes", "stacks", "off"
_ENTRY_POINTS = {  # method name -> what it does to the base weights
    "fuse_lora": _SAFE_WRITES,
    "merge_and_unload": _SAFE_WRITES,
    "merge_adapter": _SAFE_WRITES,
    "unfuse_lora": _WRITES,
    "unmerge_adapter": _WRITES,
    "load_lora_weights": _STACKS,
    "load_lora_adapter": _STACKS,
    "unload_lora_weights": _OFF,
    "unload_lora": _OFF,
    "disable_lora": _OFF,
}
_TAKES_OFF = {"unfuse_lora", "unload_lora_weights", "unload_lora", "disable_lora"}  # diffusers' "LoRA off" calls
_HOLDERS: list = []  # probes: module -> whether it holds a LoRA another layer applied
_MODULES = (
    "diffusers.loaders.lora_base",
    "diffusers.loaders.lora_pipeline",
    "diffusers.loaders.peft",
    "peft.tuners.tuners_utils",
)
_INSTEAD = {
    "fuse_lora": "lora_cache.load_lora(pipe, lora) or lora_cache.merge(model, [lora], cache_root=...)",
    "merge_and_unload": "lora_cache.merge(model, [lora], cache_root=...)",
    "merge_adapter": "lora_cache.merge(model, [lora], cache_root=...)",
    "unfuse_lora": "lora_cache.unmerge(model)",
    "unmerge_adapter": "lora_cache.unmerge(model)",
}


class ReadOnlyWeightsError(HostmemError, RuntimeError):
    """A library call would write into weights that hostmem mapped read-only."""


class LoraHeldElsewhereError(HostmemError, RuntimeError):
    """A diffusers call that takes a LoRA off would leave on the one another layer applied."""


def register_lora_holder(probe) -> None:
    """Add ``probe``, which tells whether a module holds a LoRA its caller applied (merged or
    at run time), for diffusers' "LoRA off" calls to refuse rather than return with that
    LoRA still on. The holder calls :func:`guard_foreign_writers` when it applies a LoRA."""
    if probe not in _HOLDERS:
        _HOLDERS.append(probe)


def _refuse_a_no_op(qualname: str, modules: dict[str, torch.nn.Module]) -> None:
    """Raise where a "LoRA off" call would act on no peft layer while a registered holder
    keeps a LoRA on: the call would return and the LoRA stay."""
    if not _HOLDERS or any(next(tuner_layers(m), None) for m in modules.values()):
        return  # diffusers' own layers are there: the call acts on them
    held = [".".join(p for p in (component, name) if p) for component, root in modules.items()
            for name, module in root.named_modules() if any(probe(module) for probe in _HOLDERS)]
    if held:
        names = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise LoraHeldElsewhereError(
            f"{qualname}() would return with the LoRA still on: lora_cache applied it to {len(held)} module(s) "
            f"({names}), and diffusers' call acts on its own LoRA layers only; nothing was changed. Take it off with "
            "lora_cache.unmerge(pipe.transformer) (each component it merged into; a pipeline switched as a whole goes "
            "back to the base at once) or lora_cache.set_pipeline_adapters(pipe, [], files=..., cache_root=...)"
        )


def tuner_layers(module: torch.nn.Module):
    """``(qualified name, peft layer)`` for every peft tuner layer (``base_layer`` + ``merge``)."""
    for name, sub in module.named_modules():
        if hasattr(sub, "base_layer") and callable(getattr(sub, "merge", None)) and hasattr(sub, "get_base_layer"):
            yield name, sub


def _written_weights(modules: dict[str, torch.nn.Module], only_merged: bool):
    """The base weights a merge (or, ``only_merged``, an unmerge) of these modules writes."""
    for component, module in modules.items():
        for name, layer in tuner_layers(module):
            if only_merged and not getattr(layer, "merged", False):
                continue
            base = layer.get_base_layer()
            with_bias = any(getattr(layer, "lora_bias", {}).values())  # peft merges a bias only then
            for attr, param in base._parameters.items():
                if param is not None and (attr != "bias" or with_bias):
                    yield ".".join(p for p in (component, name, "base_layer", attr) if p), param


def read_only_weights(named_tensors, areas: MappedAreas | None = None) -> list[tuple[str, str]]:
    """``(name, file)`` for each tensor that is a view of a read-only mapping (a write would fault)."""
    areas = areas or MappedAreas()
    found = []
    for name, tensor in named_tensors:
        path = areas.read_only_file(tensor)
        if path is not None:
            found.append((name, path))
    return found


def _is_merge_cache_file(path: str) -> bool:
    try:
        return str(read_header(path).metadata.get("format", "")).startswith(MERGE_CACHE_FORMAT)
    except Exception:  # not a safetensors file: not the cache's
        return False


def _listed(found: list[tuple[str, str]]) -> str:
    names = ", ".join(name for name, _ in found[:3])
    return f"{len(found)} read-only hostmem weight(s) ({names}{', ...' if len(found) > 3 else ''}; mapped from {found[0][1]})"


def _modules_of(owner) -> dict[str, torch.nn.Module]:
    if isinstance(owner, torch.nn.Module):
        return {"": owner}
    try:
        return model_components(owner)
    except TypeError:
        return {}


def _check(owner, method: str, kind: str, arguments: dict) -> None:
    """Raise before ``owner.method(...)`` runs if it would write into read-only weights."""
    modules = _modules_of(owner)
    qualname = f"{type(owner).__name__}.{method}"
    if method in _TAKES_OFF:
        _refuse_a_no_op(qualname, modules)
    if kind == _OFF:
        return
    if kind == _STACKS:
        named = ((c + "." + s.name if c else s.name, s.tensor) for c, s in iter_module_slots(modules))
        merged = [(n, p) for n, p in read_only_weights(named) if _is_merge_cache_file(p)]
        if merged:
            raise ReadOnlyWeightsError(
                f"{qualname}() on a model that holds a LoRA merged by lora_cache: {_listed(merged)}. Stack adapters "
                "through the cache instead: lora_cache.unmerge(model), then lora_cache.load_lora(pipe, [previous, new]) "
                "(or lora_cache.merge with both adapters)."
            )
        return
    if kind == _SAFE_WRITES and (arguments.get("safe_fusing") or arguments.get("safe_merge")):
        return  # merges into a copy: the mapping is never written
    found = read_only_weights(_written_weights(modules, only_merged=kind == _WRITES))
    if found:
        raise ReadOnlyWeightsError(
            f"{qualname}() would write into {_listed(found)}, which would end the process with SIGSEGV; "
            f"nothing was written. Use {_INSTEAD[method]} instead. {MAKE_WRITABLE_HINT}"
        )


_DEPTH = threading.local()


def _guarded(func, method: str, kind: str):
    """``func`` with :func:`_check` before it, in the outermost guarded call only.

    A pipeline's ``fuse_lora`` calls the base class's and each model's: the outer call
    checks every component before anything runs, and the inner ones need not check again.
    """
    signature = inspect.signature(func)

    @functools.wraps(func)
    def wrapper(self, *args, **kwargs):
        depth = getattr(_DEPTH, "value", 0)
        if depth == 0:
            try:
                arguments = signature.bind_partial(self, *args, **kwargs).arguments
            except TypeError:
                arguments = dict(kwargs)
            _check(self, method, kind, arguments)
        _DEPTH.value = depth + 1
        try:
            return func(self, *args, **kwargs)
        finally:
            _DEPTH.value = depth

    wrapper.__hostmem_guarded__ = True
    return wrapper


def _guard_module(module) -> None:
    """Wrap the entry points that the classes of ``module`` define themselves."""
    _GUARDED.add(module.__name__)
    for cls in list(vars(module).values()):
        if not isinstance(cls, type) or cls.__module__ != module.__name__:
            continue
        for method, kind in _ENTRY_POINTS.items():
            func = cls.__dict__.get(method)
            if callable(func) and not getattr(func, "__hostmem_guarded__", False):
                setattr(cls, method, _guarded(func, method, kind))


class _GuardingLoader:
    """A module's own loader, which wraps the entry points once the module has run."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _guard_module(module)


class _PostImportHook:
    """On ``sys.meta_path``: hands the watched modules' specs the :class:`_GuardingLoader`."""

    def find_spec(self, name, path, target=None):
        if name not in _MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _GuardingLoader(spec.loader)
                return spec
        return None


_INSTALLED = threading.Lock()
_HOOK = _PostImportHook()


_GUARDED: set[str] = set()  # modules whose entry points are wrapped


def guard_foreign_writers() -> None:
    """Install the entry-point checks and the fatal-signal report (idempotent, cheap).

    Called for every read-only weight handed out, so after the first call it only
    looks for watched modules imported before the hook was in place.
    """
    with _INSTALLED:
        if _HOOK not in sys.meta_path:
            sys.meta_path.insert(0, _HOOK)
        for name in _MODULES:
            module = sys.modules.get(name)
            if module is not None and name not in _GUARDED:
                _guard_module(module)
    install_fault_report()


@torch.no_grad()
def make_writable(module_or_tensor):
    """Copy read-only mapped weights into anonymous memory, on purpose.

    For a tensor, returns a writable copy (or the tensor itself when it is writable
    already). For a module, a dict of modules or a pipeline, replaces every read-only
    mapped parameter and buffer by a copy in place, everywhere the model holds it, and
    returns the bytes copied. The copies are anonymous memory, and ``hostmem.account``
    shows them so: this is the cost the read-only mapping was saving.
    """
    if isinstance(module_or_tensor, torch.Tensor):
        if MappedAreas().read_only_file(module_or_tensor) is None:
            return module_or_tensor
        return module_or_tensor.detach().clone()
    areas, copied = MappedAreas(), 0
    for _, slot in iter_module_slots(module_or_tensor):
        if areas.read_only_file(slot.tensor) is not None:
            slot.replace(slot.tensor.detach().clone())
            copied += slot.nbytes
    return copied
