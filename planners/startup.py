"""The entry point a server calls once its components are loaded.

::

    from planners import apply_pin_plan, load_config, plan_loaded

    config = load_config("configs/minimax-h3-32g.yaml")
    loaded = {"dit": dit, "text_encoder": te}
    stats = lora_cache.merge(loaded["dit"], adapters, cache_root="~/.cache/hostmem")   # if it merges
    plan = plan_loaded(config, loaded, merge_stats=stats)
    pins = apply_pin_plan(plan, loaded, config)     # keep pins.pinner alive while serving

:func:`plan_loaded` accounts the loaded components with :func:`hostmem.account`
(measured residency per parameter), groups them into the config's layers, plans
under the host limit, reports once (stderr, or one record of the ``hostmem`` logger
where logging shows it: :func:`report_once`) and returns the plan. ``planners.start``
does all of it, the merge and the pins included, from the config alone. Several ranks
on one host share one host budget, split by need (:mod:`planners.host_share`). Pinning is a separate, explicit step. ``merge_stats`` (what
``lora_cache.merge`` returned) puts the merge in the report: layers hit, built and
fallen back, bytes, seconds and rate. A component switched by ``lora_cache.set_adapters``
to a combination still being built in the background holds the build's working set
back from the budget (:func:`pending_build_reserve`), and the report says so.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Mapping

import hostmem
from lora_cache.switching.adapter_switch import build_reserve_bytes

from hostmem.errors import InputError
from .budget import HostLimit, read_host_limit
from .config import DeploymentConfig, load_config
from .deployment import DeploymentPlan, plan_deployment
from .offload_hooks import offload_warnings
from .host_checks import cache_root_warnings
from .host_share import capped_config, host_reasons, rank_limit, rank_need, share_for
from .named_components import named_components
from .report import report_text
from .reserve import process_excess
from .sizes import ComponentSizes, from_ledger
from .whatif import default_merge, merge_reason

__all__ = ["plan_loaded", "live_components", "merge_stats_dict", "pending_build_reserve", "report_once",
           "merge_mismatches"]

_MERGE_STATS_KEYS = ("layers", "hit", "built", "fallen_back", "in_place", "bytes", "bytes_written", "seconds")

_LOG = logging.getLogger("hostmem")


def live_components(config: DeploymentConfig, ledger: hostmem.Ledger) -> dict[str, ComponentSizes]:
    """Sizes and measured residency of every component of ``ledger``, by the config's layers.

    A configured component missing from the ledger is an error; a loaded module the
    config does not name is kept (``offload: none``) so its memory still counts.
    """
    missing = [name for name in config.components if name not in ledger.components]
    if missing:
        raise InputError(
            f"{config.origin.path}: components {', '.join(missing)} were not given to plan_loaded "
            f"(given: {', '.join(ledger.components) or 'none'}); pass every loaded component by its config name"
        )
    out = {}
    for name, component in ledger.components.items():
        cfg = config.components.get(name)
        if cfg is None:
            out[name] = from_ledger(component, "none", None)
        else:
            out[name] = from_ledger(
                component, cfg.offload, cfg.layer_pattern, cfg.lora_target_patterns, cfg.lora_target_bytes
            )
    return out


def pending_build_reserve(components: Mapping) -> int:
    """Bytes to hold back for the adapter builds pending on ``components`` (0: none pending).

    The largest of the components' reserves, not their sum: a process builds one
    combination at a time (one build thread), so only one build's next layer is ever
    being allocated, and a model switched as a dict shares one build across components.
    """
    return max((build_reserve_bytes(module) for module in components.values()), default=0)


def merge_stats_dict(stats) -> dict:
    """``lora_cache.MergeStats`` (or its ``to_dict()``) as plain data: sizes in bytes, times in seconds."""
    data = stats.to_dict() if hasattr(stats, "to_dict") else dict(stats)
    missing = [k for k in _MERGE_STATS_KEYS if k not in data]
    if missing:
        raise TypeError(
            f"merge_stats lacks {', '.join(missing)}: pass what lora_cache.merge() returned"
        )
    seconds = float(data["seconds"])
    data.setdefault("rate_bytes_per_s", data["bytes"] / seconds if seconds > 0 else 0.0)
    return data


def _merge_done(stats: dict) -> tuple[str, str, list[str]]:
    """The merge a server did, why the plan says so, and a warning for layers that fell back."""
    cached = stats["hit"] + stats["built"]
    where = f"cache {str(stats['cache_key'])[:12]} under {stats.get('cache_root')}" if stats.get("cache_key") else ""
    if cached:
        merge, reason = "cached", f"lora_cache.merge took {cached} of {stats['layers']} weight tensors from {where}"
    elif not stats["layers"]:
        merge, reason = "none", "lora_cache.merge changed no weight tensor"
    elif where:
        merge, reason = ("in-place",
                         f"the {where} could not store any weight tensor: lora_cache.merge merged all in place")
    else:
        merge, reason = "in-place", f"lora_cache.merge merged in place ({stats.get('cache_off') or 'the cache is off'})"
    warnings = []
    if stats["fallen_back"]:
        warnings.append(
            f"{stats['fallen_back']} merged weight tensors fell back to an in-place merge "
            "(the cache could not store them): "
            "they are anonymous memory now; free disk under the cache root or raise lora.cache.max_size, "
            "then restart to map them back"
        )
    return merge, reason, warnings


def _same_paths(paths) -> list[str]:
    return [os.path.realpath(os.path.expanduser(os.fspath(p))) for p in paths]


def merge_mismatches(config: DeploymentConfig, stats: dict) -> list[str]:
    """Warnings where the merge a server ran is not the one its config plans.

    A server that calls ``lora_cache.merge`` itself repeats the config's adapters and
    cache roots by hand; a drift plans one deployment and serves another. The stats
    name the adapter files and the root used (not the strengths: ``planners.start``
    takes all of them from the config, so nothing can drift).
    """
    lora = config.lora
    if lora is None or not lora.adapters or not stats.get("adapters"):
        return []
    from lora_cache.adapters.read import resolve_file  # the file a folder names, as the merge resolved it

    out = []
    listed = _same_paths(resolve_file(a.path) for a in lora.adapters)
    if _same_paths(stats["adapters"]) != listed:
        out.append(f"lora_cache.merge was given {', '.join(stats['adapters'])}, but lora.adapters "
                   f"({config.origin.where('lora.adapters')}) lists {', '.join(a.path for a in lora.adapters)}: "
                   "this plan is not the deployment's; merge the config's adapters (planners.start does)")
    roots = lora.cache.roots or ((lora.cache.root,) if lora.cache.root else ())
    root = stats.get("cache_root")
    if root and roots and os.path.realpath(os.path.expanduser(os.fspath(root))) not in _same_paths(roots):
        out.append(f"lora_cache.merge used the cache under {root}, but lora.cache "
                   f"({config.origin.where('lora.cache')}) names {', '.join(roots)}: a start with the config's roots builds again; pass them "
                   "(planners.start does)")
    return out


def plan_loaded(
    config: DeploymentConfig | str | os.PathLike,
    components: Mapping,
    *,
    providers=(),
    merge_stats=None,
    logger: logging.Logger | None = None,
    quiet: bool = False,
) -> DeploymentPlan:
    """Account ``components`` (``{config name: nn.Module}``, or a diffusers pipeline holding
    them as :func:`planners.start` takes one), plan, report, return the plan.

    ``merge_stats`` is what ``lora_cache.merge`` returned for these components; the
    report then shows the merge (layers hit, built, fallen back; bytes; seconds; rate).
    The report reaches a person once (:func:`report_once`); ``quiet=True`` keeps it to
    a DEBUG record.
    """
    if not isinstance(config, DeploymentConfig):
        config = load_config(config)
    components = named_components(config.components, components, config.origin.path)
    ledger = hostmem.account(components)
    sizes = live_components(config, ledger)
    host = read_host_limit(config)
    merge, reason, notes = default_merge(config), merge_reason(config), []
    stats = None if merge_stats is None else merge_stats_dict(merge_stats)
    build_reserve = pending_build_reserve(components)
    if stats is not None:
        merge, reason, notes = _merge_done(stats)
        notes += merge_mismatches(config, stats)

    def plan_under(cfg: DeploymentConfig, host: HostLimit = host) -> DeploymentPlan:
        return plan_deployment(
            cfg,
            sizes,
            host,
            mode="live",
            merge=merge,
            process_excess=process_excess(ledger.unattributed_anonymous, cfg),
            build_reserve=build_reserve,
            providers=providers,
            notes=tuple(cache_root_warnings(cfg) + offload_warnings(components) + notes),
            merge_reason=reason,
            lora_merge=stats,
        )

    plan = plan_under(config)
    mine = rank_need(plan)
    share = share_for(config, host.bytes, mine)  # None: the only rank on this host
    if share is not None:  # this rank's part of the limit (its room, not every rank's) and of the pins
        capped = plan_under(capped_config(config, share, plan.budget.committed_pinned), rank_limit(share, host, mine))
        plan = capped._replace(host_share=share.to_dict())
        over = host_reasons(share, host.bytes)  # the ranks together, not this one alone against the host
        if over:
            plan = plan._replace(verdict=plan.verdict._replace(
                fits=False, reasons=(*over, *plan.verdict.reasons), within="",
                over_limit_bytes=max(plan.verdict.over_limit_bytes, share.host_committed - host.bytes, 0)))
    report_once(report_text(plan), logger, quiet)
    return plan


def report_once(text: str, logger: logging.Logger | None = None, quiet: bool = False) -> None:
    """The report as one log record where logging would show it, else on stderr.

    A server that has not configured logging would drop an INFO record (Python's last
    resort handler shows warnings only), and one that has would show a printed report
    twice in its log; so: a record for a given ``logger`` or for the ``hostmem`` logger
    when a handler would emit it at INFO, stderr otherwise.
    """
    log = logger or _LOG
    if quiet:
        log.debug("host memory plan\n%s", text)
    elif logger is not None or (log.isEnabledFor(logging.INFO) and log.hasHandlers()):
        log.info("host memory plan\n%s", text)
    else:
        print(f"host memory plan\n{text}", file=sys.stderr, flush=True)
