"""``{config name: module}`` from what a server hands over: that mapping, or a diffusers pipeline.

:func:`planners.start`, :func:`planners.startup.plan_loaded` and :func:`planners.execute`
take either; a pipeline's component is its attribute of the config's name, or of the name
diffusers gives it (a config's ``dit`` is a pipeline's ``transformer`` or ``unet``).
"""

from __future__ import annotations

from typing import Iterable, Mapping

from hostmem.errors import InputError

__all__ = ["PIPELINE_NAMES", "named_components"]

# Config names a diffusers pipeline spells otherwise: the DiT is its transformer (or unet).
PIPELINE_NAMES = {"dit": ("transformer", "unet")}


def named_components(names: Iterable[str], given, where: str, *, every: bool = True) -> dict:
    """``given`` as ``{name: module}``: a mapping as it is, else each of ``names`` looked up
    as an attribute of ``given`` (a pipeline). A name it lacks is an error naming what it
    holds when ``every``; else it is left out (the caller says which it needs). ``where``
    begins each message (the config's path, the plan's deployment)."""
    if isinstance(given, Mapping):
        return dict(given)
    names = list(names)
    example = ", ".join(f"'{n}': ..." for n in names[:2]) or "'name': module"
    if not hasattr(given, "components"):  # a lone module, or anything else: no pipeline
        raise InputError(f"{where}: a {type(given).__name__} was given where {{config name: module}} or a "
                         f"diffusers pipeline is expected; pass {{{example}}}")
    out, missing = {}, []
    for name in names:
        found = next((getattr(given, n) for n in (name, *PIPELINE_NAMES.get(name, ()))
                      if getattr(given, n, None) is not None), None)
        if found is None:
            missing.append(name)
        else:
            out[name] = found
    if missing and every:
        held = sorted(k for k, v in getattr(given, "components", {}).items() if v is not None)
        raise InputError(
            f"{where}: components {', '.join(missing)} are not attributes of the {type(given).__name__} given "
            f"(it holds {', '.join(held) or 'none'}); name the config's components as the pipeline does, "
            "or pass {config name: module}"
        )
    return out
