"""A config file as a whole: read it, apply the environment overrides, parse each section."""

from __future__ import annotations

import os
import stat
from typing import Mapping

from hostmem.units import format_size

from .components import check_experts, parse_components
from .host import parse_device, parse_host, parse_transfer, parse_workload
from .lora import parse_lora
from .model import DeploymentConfig
from .parallel import parse_parallel
from .source import ConfigError, ConfigOrigin, Section, kind, load_yaml_with_lines

__all__ = ["ENV_OVERRIDES", "parse_config", "load_config"]

ENV_OVERRIDES: dict[str, str] = {
    "HOSTMEM_HOST_LIMIT": "host.limit",
    "HOSTMEM_HOST_RESERVE": "host.reserve",
    "HOSTMEM_MAX_PINNED": "host.max_pinned",
    "HOSTMEM_DEVICE_VRAM": "device.vram",
}


def _apply_overrides(data: dict, environ: Mapping[str, str]) -> dict[str, str]:
    """Write ``HOSTMEM_*`` values into ``data``; return ``{key: variable}`` of those used."""
    used = {}
    for variable, key in ENV_OVERRIDES.items():
        value = environ.get(variable)
        if value is None or value.strip() == "":
            continue
        section, name = key.split(".")
        if data.get(section) is None:  # absent: made for the override
            data[section] = {}
        elif not isinstance(data[section], dict):  # a bad section stays, for its own error at its line
            continue
        data[section][name] = value.strip()
        used[key] = variable
    return used


_TOP_KEYS = ("deployment", "host", "device", "transfer", "workload", "components", "lora", "parallel")


def parse_config(text: str, path: str, environ: Mapping[str, str] | None = None) -> DeploymentConfig:
    """Parse the YAML ``text`` of the file ``path`` (``path`` names it and anchors relative paths)."""
    data, lines = load_yaml_with_lines(text, path)
    origin = ConfigOrigin(path=path, lines=lines)
    if not isinstance(data, dict):
        raise ConfigError(path, "", f"expected a mapping with {', '.join(_TOP_KEYS)}, found {kind(data)}")
    overrides = _apply_overrides(data, os.environ if environ is None else environ)
    origin = ConfigOrigin(path=path, lines=lines, overrides=overrides)
    top = Section(origin, "", data, _TOP_KEYS)
    name = top.require("deployment", "name the deployment, e.g. deployment: minimax-h3-32g")
    if not isinstance(name, str):
        raise origin.error("deployment", f"expected a name, found {kind(name)}")
    if not name.strip():
        raise origin.error("deployment", "is empty; name the deployment (the report and the cache records say it)")
    components = parse_components(origin, data.get("components"))
    host, device = parse_host(origin, data.get("host")), parse_device(origin, data.get("device"))
    transfer, workload = parse_transfer(origin, data.get("transfer")), parse_workload(origin, data.get("workload"))
    check_experts(origin, components, workload.steps)
    from ..calibration import resolve_transfer  # measured rates: the last hostmem calibrate --save
    from ..reserve import resolve_reserve  # a measured reserve: the deployment's last warmup

    config = DeploymentConfig(
        deployment=name,
        host=host,
        device=device,
        transfer=transfer,
        workload=workload,
        components=components,
        lora=parse_lora(origin, data.get("lora"), components),
        origin=origin,
        parallel=parse_parallel(origin, data.get("parallel"), components),
    )
    _one_merge_target(origin, config)
    return resolve_transfer(resolve_reserve(config))


def _one_merge_target(origin: ConfigOrigin, config) -> None:
    """``lora_targets`` on a component the merge does not write into would be charged
    nothing (a Wan 2.2 pair of adapters for both experts: the second expert's dropped)."""
    target = config.merge_target
    for component in config.components.values():
        if component.has_lora_targets and component is not target:
            chosen = f"into {target.name!r}" if target is not None else "into no component"
            raise origin.error(
                f"components.{component.name}.lora_targets",
                f"the plan charges a LoRA merge {chosen} (lora.component, else the first component with "
                f"lora_targets) and never into {component.name!r}: remove its lora_targets, or plan each "
                "component's merge in a config of its own")


MAX_CONFIG_BYTES = 16 << 20  # a config is a few KiB; a path that names a disk image or a model is a mistake


def load_config(path: str | os.PathLike, environ: Mapping[str, str] | None = None) -> DeploymentConfig:
    """Read and validate a deployment config; ``environ`` defaults to ``os.environ``."""
    path = os.fspath(path)
    if "\0" in path:
        raise ConfigError(repr(path), "", "a path cannot hold a NUL byte; name the .yaml file")
    try:  # O_NONBLOCK: a FIFO's open does not wait for a writer (it is refused below)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with open(fd, "rb") as handle:
            found = os.fstat(handle.fileno())
            if stat.S_ISDIR(found.st_mode):
                raise IsADirectoryError(path)
            if not stat.S_ISREG(found.st_mode):
                raise ConfigError(path, "", "not a regular file (a FIFO, socket or device); name the deployment's "
                                  ".yaml file")
            if found.st_size > MAX_CONFIG_BYTES:
                raise ConfigError(path, "", f"holds {format_size(found.st_size)}, more than a deployment config "
                                  f"does (at most {format_size(MAX_CONFIG_BYTES)}); name the deployment's .yaml file")
            text = handle.read(MAX_CONFIG_BYTES + 1).decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(path, "", "no such config file") from None
    except IsADirectoryError:
        raise ConfigError(path, "", "is a folder; name a .yaml file") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(path, "", f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return parse_config(text, path, environ)
