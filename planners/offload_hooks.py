"""Offload hooks another library put on a module: the executor refuses to run over them.

diffusers' ``enable_group_offload`` (a ``group_offloading`` hook in each module's
``_diffusers_hook`` registry), ``enable_model_cpu_offload`` and
``enable_sequential_cpu_offload`` (accelerate's hooks, ``_hf_hook``), and accelerate's
``cpu_offload``/``disk_offload`` move weights themselves, at their own hooks: under the
executor a layer would be moved twice, and the executor's copy would be of whatever
the other hook left. diffusers' caching hooks (first-block cache, FasterCache, ...)
move nothing and are welcome.

Group offloading also undoes :func:`hostmem.remap`: it keeps its own copy of every
weight on the host (a pinned copy with streams; otherwise the tensor moved back from
the device after each use), so mapped weights turn anonymous without a word.
:func:`offload_warnings` says so; :func:`planners.startup.plan_loaded` shows it with
the plan.
"""

from __future__ import annotations

from typing import Mapping

from hostmem.errors import InputError

__all__ = ["offload_hooks", "offload_warnings", "refuse_offload_hooks"]

_DIFFUSERS_OFFLOAD = ("group_offloading", "lazy_prefetch_group_offloading", "layer_execution_tracker")
_SHOWN = 3


def offload_hooks(module) -> list[str]:
    """``"name: whose hook"`` for every submodule of ``module`` that carries an offload hook."""
    found = []
    for name, sub in module.named_modules():
        where = name or "(the module itself)"
        accelerate = getattr(sub, "_hf_hook", None)
        if accelerate is not None:
            found.append(f"{where}: accelerate's {type(accelerate).__name__}")
        registry = getattr(sub, "_diffusers_hook", None)
        for hook in getattr(registry, "hooks", None) or {}:
            if hook in _DIFFUSERS_OFFLOAD:
                found.append(f"{where}: diffusers' {hook}")
    return found


def _listed(found: list[str]) -> str:
    more = f" and {len(found) - _SHOWN} more" if len(found) > _SHOWN else ""
    return "; ".join(found[:_SHOWN]) + more


def refuse_offload_hooks(components: Mapping[str, object]) -> None:
    """A clear refusal when any component already carries another library's offload hooks."""
    for component, module in components.items():
        found = offload_hooks(module)
        if found:
            raise InputError(
                f"{component}: the module already carries offload hooks ({_listed(found)}); they move weights "
                "themselves, so under the executor each layer would be moved twice. Leave the offloading to the "
                "executor: load the pipeline without enable_model_cpu_offload / enable_sequential_cpu_offload / "
                "enable_group_offload, or remove them first (pipe.remove_all_hooks() for accelerate's; a fresh "
                "load for group offloading), then call planners.execute"
            )


def offload_warnings(components: Mapping[str, object]) -> list[str]:
    """A warning for each component under diffusers' group offloading: it turns mapped weights anonymous."""
    out = []
    for component, module in components.items():
        found = [f for f in offload_hooks(module) if "diffusers' group_offloading" in f]
        if found:
            out.append(
                f"{component} carries diffusers' group offloading ({_listed(found)}): it keeps its own host copy "
                "of every weight (pinned with streams, else moved back from the device after each use), so weights "
                "that hostmem.remap or the LoRA cache mapped read-only turn anonymous at the first pass. Use "
                "planners.execute for the offload instead, or leave group offloading off"
            )
    return out
