"""Deployment configs: one YAML file per deployment, parsed into immutable records.

A config names the host, the device, the cost model, the workload and the
components (see ``configs/*.yaml``). Every problem is a :class:`ConfigError` that
names the file, the key and the line, and says what to do: an unknown key, a size
or percentage that does not parse, a path that does not exist, impossible numbers.

Human units go through :mod:`hostmem.units` only. A component is given by its
checkpoint (``path``: a ``.safetensors`` file or a folder of them) or, to plan a
machine you do not have the weights on, by declared sizes (``size``, ``layers`` as
a count, ``lora_targets``). Relative paths are resolved against the config file's
folder, so a config and its checkpoints can move together.

Environment overrides (nothing else here reads the environment):

- ``HOSTMEM_HOST_LIMIT``: ``host.limit`` (a size, or ``auto``)
- ``HOSTMEM_HOST_RESERVE``: ``host.reserve``
- ``HOSTMEM_MAX_PINNED``: ``host.max_pinned`` (a share of the limit, ``75%`` or ``0.75``, or a
  size with a unit; a number without a unit is always a share)
- ``HOSTMEM_DEVICE_VRAM``: ``device.vram``

An overridden key is reported as coming from the variable, so an error points at
the variable rather than at a line that was not used.

Modules, each with one job: ``source`` (YAML with the line of every key, the
:class:`ConfigError` and field-by-field reading of a section), ``model`` (the immutable
records a config becomes), ``host`` (the host, device, transfer and workload
sections), ``components``, ``lora`` (adapters and the merge cache) and ``load``
(the file, the environment overrides and the whole config).
"""

from __future__ import annotations

from . import model
from .load import ENV_OVERRIDES, load_config, parse_config
from .model import (
    AdapterConfig,
    ComponentConfig,
    DeploymentConfig,
    DeviceConfig,
    HostConfig,
    LoraCacheConfig,
    LoraConfig,
    ParallelConfig,
    TransferConfig,
    WorkloadConfig,
)
from .source import ConfigError, ConfigOrigin

__all__ = ["ConfigError", "ConfigOrigin", *model.__all__, "ENV_OVERRIDES", "load_config", "parse_config"]
