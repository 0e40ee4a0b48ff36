"""The what-if plan of a deployment config, as ``hostmem plan`` prints it.

The command (:mod:`planners.commands.plan`) prints it; the demo's verdicts
(:mod:`planners.demo.verdicts`) are taken from it too, so that both say the same thing.
Reads no weights: sizes from headers or the config's declared sizes.
"""

from __future__ import annotations

__all__ = ["build_plan"]


def _providers(config, sizes, merge) -> list:
    """The LoRA merge cache as a provider, when the plan merges in place and the cache is on.

    A plan that already merges through the cache has no anonymous merge to give back,
    so the offer only has something to say next to an in-place merge.
    """
    target = config.merge_target
    lora = config.lora
    if merge != "in-place" or target is None or lora is None or not lora.adapters or not lora.cache.enabled:
        return []
    from lora_cache.provider import LoraCacheProvider
    from planners.whatif import in_place_merge_bytes

    merged = sizes[target.name]
    return [LoraCacheProvider(target.name, merged.lora_target_bytes, layers=len(merged.layers),
                              in_place_bytes=in_place_merge_bytes(config, sizes))]


def _without_cache(config, merge, sizes) -> tuple:
    """A cached plan's counterfactual: the same deployment merging in place.

    A cached merge has no anonymous bytes left to offer, so the budget the cache gives
    back shows only beside the plan without it: the in-place merge, planned next to it.
    """
    from planners.whatif import what_if_components

    target = config.merge_target
    if merge != "cached" or target is None or not sizes[target.name].lora_target_bytes:
        return ()
    in_place, _ = what_if_components(config, "in-place", sizes)
    return (("without the LoRA merge cache", "in-place", in_place),)


def build_plan(config, what_if: str | None = None, ranks: int | None = None, environ=None):
    """The what-if plan ``hostmem plan`` prints for ``config`` (a ``DeploymentConfig``):
    ``what_if`` the merge (None: the config's own), ``ranks`` as ``--ranks``. The demo's
    verdicts come from here too, so they are the plan's."""
    import os

    from planners.adapter_targets import check_adapter_files
    from planners.budget import read_host_limit
    from planners.config.parallel import with_ranks
    from planners.deployment import plan_deployment
    from planners.host_checks import cache_root_warnings, missing_adapter_warnings
    from planners.rank_plan import rank_components
    from planners.whatif import checkpoint_sizes, default_merge, merge_reason, what_if_components

    config = config._replace(parallel=with_ranks(config.parallel, ranks, os.environ if environ is None else environ))
    if any(c.path is not None for c in config.components.values()):
        check_adapter_files(config)  # weights on this machine: so must the adapters be (exit 2)
    adapter_notes = missing_adapter_warnings(config)  # declared sizes: the plan reads no adapter, but says so
    merge = what_if or default_merge(config)
    reason = f"asked for with --what-if {merge}" if what_if else merge_reason(config)
    sizes = rank_components(config, checkpoint_sizes(config))
    components, notes = what_if_components(config, merge, sizes)
    host = read_host_limit(config)
    notes += cache_root_warnings(config) + adapter_notes
    return plan_deployment(
        config, components, host, mode="what-if", merge=merge, notes=tuple(notes),
        providers=_providers(config, sizes, merge), merge_reason=reason,
        alternatives=_without_cache(config, merge, sizes), ranks=config.parallel.ranks,
    )
