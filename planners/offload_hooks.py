"""Offload hooks another library put on a module: the executor refuses to run over them.

diffusers' ``enable_group_offload`` (a ``group_offloading`` hook in each module's
``_diffusers_hook`` registry), ``enable_model_cpu_offload`` and
``enable_sequential_cpu_offload`` (accelerate's hooks, ``_hf_hook``), accelerate's
``cpu_offload``/``disk_offload``, and cache-dit's ``layerwise_offload`` /
``layerwise_cpu_offload`` (forward hooks on each target, their handles listed on the root
in ``_cache_dit_layerwise_offload_handles``) move weights themselves, at their own hooks:
under the executor a layer would be moved twice, and the executor's copy would be of
whatever the other hook left. diffusers' caching hooks (first-block cache, FasterCache,
...) and cache-dit's caches (DBCache, DBPrune) move nothing and are welcome.

Group offloading and cache-dit's layer-wise offload also undo :func:`hostmem.remap`:
each keeps its own copy of every weight on the host (group offloading a pinned copy with
streams, otherwise the tensor moved back from the device after each use; cache-dit a
pinned copy made when it is applied, to which the module's weights are rebound), so
mapped weights turn anonymous without a word. :func:`offload_warnings` says so;
:func:`planners.startup.plan_loaded` shows it with the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple

from hostmem.errors import InputError

__all__ = ["offload_hooks", "offload_warnings", "refuse_offload_hooks"]

_SHOWN = 3


def _accelerate_hooks(sub) -> list[str]:
    hook = getattr(sub, "_hf_hook", None)
    return [] if hook is None else [type(hook).__name__]


def _diffusers_hooks(sub) -> list[str]:
    registry = getattr(sub, "_diffusers_hook", None)
    offload = ("group_offloading", "lazy_prefetch_group_offloading", "layer_execution_tracker")
    return [hook for hook in getattr(registry, "hooks", None) or {} if hook in offload]


def _cache_dit_hooks(sub) -> list[str]:
    # the handles layerwise_offload attaches to each root it offloads; removing them drops the list
    return ["layerwise_offload"] if getattr(sub, "_cache_dit_layerwise_offload_handles", None) else []


@dataclass(frozen=True)
class _Offloader:
    """One library's offload hooks: how a submodule shows them, how a user leaves them off,
    and, for each hook that keeps its own host copy of every weight, ``(what it is, what the
    copy is, when mapped weights turn anonymous)``."""

    owner: str
    hooks: Callable[[object], list[str]]
    instead: str
    host_copies: Mapping[str, tuple[str, str, str]] = field(default_factory=dict)


_OFFLOADERS = (
    _Offloader("accelerate's", _accelerate_hooks,
               "load the pipeline without enable_model_cpu_offload / enable_sequential_cpu_offload, or remove "
               "accelerate's hooks first (pipe.remove_all_hooks())"),
    _Offloader("diffusers'", _diffusers_hooks, "load the pipeline afresh without enable_group_offload",
               {"group_offloading": ("diffusers' group offloading", "pinned with streams, else the tensor moved back "
                                     "from the device after each use", "at the first pass")}),
    _Offloader("cache-dit's", _cache_dit_hooks,
               "call no cache_dit.layerwise_offload / layerwise_cpu_offload, or remove it first "
               "(cache_dit.remove_layerwise_offload(pipe); the weights stay in its pinned copies, so load afresh "
               "to keep them mapped)",
               {"layerwise_offload": ("cache-dit's layer-wise offload", "pinned, made by the call that applies it, "
                                      "which rebinds the module's weights to it", "at that call")}),
)


class _Hook(NamedTuple):
    offloader: _Offloader
    name: str
    where: str  # the submodule that carries it

    def __str__(self) -> str:
        return f"{self.where}: {self.offloader.owner} {self.name}"


def _found(module) -> list[_Hook]:
    """Every offload hook on ``module`` and its submodules."""
    return [_Hook(offloader, hook, name or "(the module itself)")
            for name, sub in module.named_modules() for offloader in _OFFLOADERS for hook in offloader.hooks(sub)]


def _named(found: list[_Hook]) -> str:
    """The first few hooks as ``"where: whose hook"``, and how many more."""
    more = f" and {len(found) - _SHOWN} more" if len(found) > _SHOWN else ""
    return "; ".join(map(str, found[:_SHOWN])) + more


def offload_hooks(module) -> list[str]:
    """``"name: whose hook"`` for every submodule of ``module`` that carries an offload hook."""
    return [str(hook) for hook in _found(module)]


def refuse_offload_hooks(components: Mapping[str, object]) -> None:
    """A clear refusal when any component already carries another library's offload hooks."""
    for component, module in components.items():
        found = _found(module)
        if found:
            instead = "; ".join(dict.fromkeys(hook.offloader.instead for hook in found))
            raise InputError(
                f"{component}: the module already carries offload hooks ({_named(found)}); they move weights "
                "themselves, so under the executor each layer would be moved twice. Leave the offloading to the "
                f"executor: {instead}; then call planners.execute"
            )


def offload_warnings(components: Mapping[str, object]) -> list[str]:
    """A warning for each component under an offload that keeps its own host copy of every weight
    (diffusers' group offloading, cache-dit's layer-wise offload): mapped weights turn anonymous."""
    out = []
    for component, module in components.items():
        found = _found(module)
        for offloader in _OFFLOADERS:
            for hook, (what, copy, when) in offloader.host_copies.items():
                here = [f for f in found if f.offloader is offloader and f.name == hook]
                if here:
                    out.append(
                        f"{component} carries {what} ({_named(here)}): it keeps its own host copy of every weight "
                        f"({copy}), so weights that hostmem.remap or the LoRA cache mapped read-only turn anonymous "
                        f"{when}. Use planners.execute for the offload instead, or leave {what} off"
                    )
    return out
