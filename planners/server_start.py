"""One call at a server's start: merge, account, plan, pin, report (``planners.start``).

::

    import planners

    started = planners.start("configs/minimax-h3-32g.yaml", pipe)   # or {"dit": dit, ...}
    # serve; keep ``started`` alive (its pins live as long as started.pins)

The config already names the adapters, their strengths and overrides, and the cache
roots; a server that repeated them by hand in its own ``load_lora`` call could drift
from what was planned, so this call takes them from the config and nothing else:
the adapters are merged through the config's cache roots into the component the
config merges into (``lora_cache.merge``, diffusers' converter for a diffusers model),
then :func:`planners.startup.plan_loaded` accounts and plans, and
:func:`planners.pin_apply.apply_pin_plan` pins what the plan says. The report is
printed to stderr unless ``quiet=True`` (or logged, where logging is configured).
"""

from __future__ import annotations

import os
from typing import Mapping, NamedTuple
from hostmem.errors import InputError

from .config import DeploymentConfig, load_config
from .named_components import named_components

__all__ = ["Started", "start", "loaded_components", "config_adapters"]


class Started(NamedTuple):
    """What :func:`start` did: the plan, the pins (keep them alive), the merge's stats."""

    plan: object  # planners.deployment.DeploymentPlan
    pins: object | None  # planners.pin_apply.AppliedPins, None with pin=False
    merge_stats: object | None  # lora_cache.MergeStats, None without adapters
    components: Mapping  # {config name: nn.Module}, as planned


def loaded_components(config: DeploymentConfig, components_or_pipe) -> dict:
    """``{config name: module}`` from a dict, or from a pipeline's attributes by config name."""
    return named_components(config.components, components_or_pipe, config.origin.path)


def config_adapters(config: DeploymentConfig) -> list:
    """The config's adapters as ``lora_cache.Adapter`` (strength, alpha, rules, strict, rslora)."""
    from lora_cache import Adapter

    return [Adapter(a.path, a.strength, alpha=a.alpha, rules=a.rules, strict=a.strict, rslora=a.rslora)
            for a in (config.lora.adapters if config.lora else ())]


def _merge_into(config: DeploymentConfig) -> str:
    """The component the config's adapters go into: lora.component, the merge target, the streamed one."""
    chosen = config.merge_target or config.streamed
    if chosen is None:
        raise InputError(f"{config.origin.path}: lora.adapters are listed but no component takes them; "
                         "set lora.component")
    return chosen.name


def _merge(config: DeploymentConfig, components: dict, progress: bool | None):
    """Merge the config's adapters through its cache roots; None when it lists none."""
    lora = config.lora
    if lora is None or not lora.adapters:
        return None
    import lora_cache

    name = _merge_into(config)
    base = config.components[name]
    base_files = None
    if base.path is not None:
        from .checkpoint import checkpoint_files

        base_files = checkpoint_files(base.path, base.variant)
    return lora_cache.merge(
        components[name], config_adapters(config), list(lora.cache.roots) or None,
        enabled=lora.cache.enabled, max_size=lora.cache.max_size, base_files=base_files, progress=progress,
    )


def start(
    config: DeploymentConfig | str | os.PathLike,
    components_or_pipe,
    *,
    quiet: bool = False,
    pin: bool = True,
    providers=(),
    progress: bool | None = False,
) -> Started:
    """Merge the config's adapters, account, plan, pin and report; return :class:`Started`.

    ``components_or_pipe`` is ``{config name: nn.Module}`` or a pipeline whose attributes
    carry the config's component names (``dit`` may be its ``transformer`` or ``unet``).
    ``providers`` are offered to the plan (``planners.providers.remap_providers``);
    ``pin=False`` plans without pinning. The verdict is the report's first line and
    ``started.plan.fits``.
    """
    from .pin_apply import apply_pin_plan
    from .startup import plan_loaded

    if not isinstance(config, DeploymentConfig):
        config = load_config(config)
    components = loaded_components(config, components_or_pipe)
    stats = _merge(config, components, progress)
    plan = plan_loaded(config, components, providers=providers, merge_stats=stats, quiet=quiet)
    pins = apply_pin_plan(plan, components, config) if pin else None
    return Started(plan, pins, stats, components)
