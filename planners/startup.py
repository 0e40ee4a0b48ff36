"""The entry point a server calls once its components are loaded.

::

    from planners.startup import plan_loaded
    from planners.pin_apply import apply_pin_plan

    config = load_config("configs/minimax-h3-32g.yaml")
    loaded = {"dit": dit, "text_encoder": te}
    plan = plan_loaded(config, loaded)
    pins = apply_pin_plan(plan, loaded, config)     # keep pins.pinner alive while serving

:func:`plan_loaded` accounts the loaded components with :func:`hostmem.account`
(measured residency per parameter), groups them into the config's layers, plans
under the host limit, logs the report once (logger ``hostmem``, one record) and
returns the plan. Pinning is a separate, explicit step.
"""

from __future__ import annotations

import logging
import os
from typing import Mapping

import hostmem

from .budget import read_host_limit
from .config import DeploymentConfig, load_config
from .deployment import DeploymentPlan, plan_deployment
from .host_checks import cache_root_warnings
from .report import report_text
from .sizes import ComponentSizes, from_ledger
from .whatif import default_merge

__all__ = ["plan_loaded", "live_components"]

_LOG = logging.getLogger("hostmem")


def live_components(config: DeploymentConfig, ledger: hostmem.Ledger) -> dict[str, ComponentSizes]:
    """Sizes and measured residency of every component of ``ledger``, by the config's layers.

    A configured component missing from the ledger is an error; a loaded module the
    config does not name is kept (``offload: none``) so its memory still counts.
    """
    missing = [name for name in config.components if name not in ledger.components]
    if missing:
        raise ValueError(
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


def plan_loaded(
    config: DeploymentConfig | str | os.PathLike,
    components: Mapping,
    *,
    providers=(),
    logger: logging.Logger | None = None,
) -> DeploymentPlan:
    """Account ``components`` (``{config name: nn.Module}``), plan, log the report, return the plan."""
    if not isinstance(config, DeploymentConfig):
        config = load_config(config)
    ledger = hostmem.account(dict(components))
    sizes = live_components(config, ledger)
    host = read_host_limit(config)
    plan = plan_deployment(
        config,
        sizes,
        host,
        mode="live",
        merge=default_merge(config),
        process_excess=max(0, ledger.unattributed_anonymous - config.host.reserve),
        providers=providers,
        notes=tuple(cache_root_warnings(config)),
    )
    (logger or _LOG).info("host memory plan\n%s", report_text(plan))
    return plan
