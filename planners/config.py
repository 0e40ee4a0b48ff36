"""Deployment configs: one YAML file per deployment, parsed into frozen dataclasses.

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
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

from hostmem.units import parse_fraction, parse_rate, parse_size

from .config_source import ConfigError, ConfigOrigin, Section, kind, load_yaml_with_lines

__all__ = [
    "ConfigError",
    "ConfigOrigin",
    "HostConfig",
    "DeviceConfig",
    "TransferConfig",
    "WorkloadConfig",
    "ComponentConfig",
    "AdapterConfig",
    "LoraCacheConfig",
    "LoraConfig",
    "DeploymentConfig",
    "ENV_OVERRIDES",
    "load_config",
    "parse_config",
]

ENV_OVERRIDES: dict[str, str] = {
    "HOSTMEM_HOST_LIMIT": "host.limit",
    "HOSTMEM_HOST_RESERVE": "host.reserve",
    "HOSTMEM_MAX_PINNED": "host.max_pinned",
    "HOSTMEM_DEVICE_VRAM": "device.vram",
}

OFFLOAD_MODES = ("layerwise", "full", "none")
LOAD_MODES = ("mapped", "copied")
DTYPES = ("bf16", "fp16", "fp32", "fp8", "int8", "uint8")


@dataclass(frozen=True)
class HostConfig:
    """The host limit the deployment plans for, and what is kept back from it."""

    limit: int | None  # None: "auto", the tighter of MemTotal and the cgroup limit
    reserve: int
    max_pinned_fraction: float | None = 0.75
    max_pinned_bytes: int | None = None

    def max_pinned(self, limit: int) -> int:
        """The most bytes that may be pinned under ``limit``."""
        if self.max_pinned_bytes is not None:
            return min(self.max_pinned_bytes, limit)
        return int(limit * (self.max_pinned_fraction if self.max_pinned_fraction is not None else 1.0))


@dataclass(frozen=True)
class DeviceConfig:
    """The VRAM the streamed component may use; ``vram == 0`` streams every layer."""

    vram: int = 0
    reserve: int = 0


@dataclass(frozen=True)
class TransferConfig:
    """The cost model, in bytes per second; measured values should replace the defaults."""

    pinned_h2d: float = 24e9
    pageable_h2d: float = 8e9
    disk_read: float = 3e9


@dataclass(frozen=True)
class WorkloadConfig:
    steps: int
    passes_per_step: int = 1

    @property
    def passes(self) -> int:
        """How often a streamed layer moves per request."""
        return self.steps * self.passes_per_step


@dataclass(frozen=True)
class ComponentConfig:
    """One component: a checkpoint (``path``) or declared sizes (``size``)."""

    name: str
    offload: str
    path: str | None = None
    layer_pattern: str | None = None
    layer_count: int | None = None
    size: int | None = None
    lora_target_bytes: int | None = None
    lora_target_patterns: tuple[str, ...] = ()
    dtype: str | None = None
    load: str = "mapped"
    prefetch: int = 1

    @property
    def has_lora_targets(self) -> bool:
        return bool(self.lora_target_bytes) or bool(self.lora_target_patterns)


@dataclass(frozen=True)
class AdapterConfig:
    """One adapter: file, strength, and optional overrides (see ``lora_cache.Adapter``).

    ``rules`` are ``({match: REGEX, replace: MODULE}, ...)`` tried before the built-in
    key prefixes; ``strict: false`` turns keys that match nothing into a warning.
    """

    path: str
    strength: float = 1.0
    alpha: float | None = None
    rules: tuple = ()
    strict: bool = True
    rslora: bool | None = None


@dataclass(frozen=True)
class LoraCacheConfig:
    root: str | None = None
    enabled: bool = True
    max_size: int | None = None


@dataclass(frozen=True)
class LoraConfig:
    """Adapters and the merged-weight cache (read by the LoRA provider).

    Adapter paths are not checked here: the loader checks them, so a deployment can
    be planned on a machine that does not hold the files.
    """

    adapters: tuple[AdapterConfig, ...] = ()
    cache: LoraCacheConfig = LoraCacheConfig()
    component: str | None = None


@dataclass(frozen=True)
class DeploymentConfig:
    deployment: str
    host: HostConfig
    device: DeviceConfig
    transfer: TransferConfig
    workload: WorkloadConfig
    components: Mapping[str, ComponentConfig]
    lora: LoraConfig | None
    origin: ConfigOrigin

    @property
    def streamed(self) -> ComponentConfig | None:
        """The component streamed layer by layer (``offload: layerwise``), if any."""
        return next((c for c in self.components.values() if c.offload == "layerwise"), None)

    @property
    def merge_target(self) -> ComponentConfig | None:
        """The component a LoRA merge writes into: ``lora.component`` or the one with targets."""
        if self.lora is not None and self.lora.component:
            return self.components[self.lora.component]
        return next((c for c in self.components.values() if c.has_lora_targets), None)


# ---------------------------------------------------------------- sections


def _host(origin: ConfigOrigin, data: Any) -> HostConfig:
    s = Section(origin, "host", data, ("limit", "reserve", "max_pinned"))
    limit_text = s.get("limit", "auto")
    limit = None if str(limit_text).strip().lower() == "auto" else s.parsed(
        "limit", parse_size, advice="write a size such as 32GiB, or auto"
    )
    if limit == 0:
        raise origin.error("host.limit", "0 leaves nothing to plan; write a size such as 32GiB, or auto")
    reserve = s.size("reserve", parse_size("4GiB"))
    if limit is not None and reserve >= limit:
        raise origin.error(
            "host.reserve",
            f"{s.get('reserve')!r} is not below host.limit {limit_text!r}; lower the reserve or raise the limit",
        )
    fraction, cap = _max_pinned(s)
    return HostConfig(limit=limit, reserve=reserve, max_pinned_fraction=fraction, max_pinned_bytes=cap)


_BARE_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _is_bare_number(value: Any) -> bool:
    """A number without a unit: ``1``, ``0.75``, or the text ``"1"`` of an override."""
    if isinstance(value, bool):
        return False
    return isinstance(value, (int, float)) or (isinstance(value, str) and bool(_BARE_NUMBER.fullmatch(value.strip())))


def _max_pinned(s: Section) -> tuple[float | None, int | None]:
    """``max_pinned`` is a share of the limit (``75%``, ``0.75``) or a size with a unit (``18GiB``).

    A bare number is a share, so it must lie in [0, 1]: ``max_pinned: 1`` is all of the
    limit, never 1 byte, and ``max_pinned: 16`` (16 bytes? 16%? 16 GiB?) is refused.
    """
    value = s.get("max_pinned", "75%")
    if _is_bare_number(value):
        if not 0.0 <= float(value) <= 1.0:
            raise s.origin.error(
                s.sub("max_pinned"),
                f"{value!r} is a number without a unit, read as a share of the limit, so it must lie between "
                "0 and 1; write a share (75% or 0.75) or a size with its unit (18GiB)",
            )
        return float(value), None
    if isinstance(value, str) and value.strip().endswith("%"):
        return s.parsed("max_pinned", parse_fraction, 0.75, "write e.g. 75% or 18GiB"), None
    return None, s.parsed("max_pinned", parse_size, None, "write e.g. 75% or 18GiB")


def _device(origin: ConfigOrigin, data: Any) -> DeviceConfig:
    s = Section(origin, "device", data, ("vram", "reserve"))
    vram, reserve = s.size("vram", 0), s.size("reserve", 0)
    if vram and reserve >= vram:
        raise origin.error("device.reserve", f"{s.get('reserve')!r} is not below device.vram {s.get('vram')!r}")
    return DeviceConfig(vram=vram, reserve=reserve)


def _transfer(origin: ConfigOrigin, data: Any) -> TransferConfig:
    s = Section(origin, "transfer", data, ("pinned_h2d", "pageable_h2d", "disk_read"))
    d = TransferConfig()
    return TransferConfig(
        pinned_h2d=s.parsed("pinned_h2d", parse_rate, d.pinned_h2d),
        pageable_h2d=s.parsed("pageable_h2d", parse_rate, d.pageable_h2d),
        disk_read=s.parsed("disk_read", parse_rate, d.disk_read),
    )


def _workload(origin: ConfigOrigin, data: Any) -> WorkloadConfig:
    s = Section(origin, "workload", data, ("steps", "passes_per_step"))
    s.require("steps", "say how many denoising steps a request runs, e.g. steps: 4")
    return WorkloadConfig(steps=s.integer("steps", None, 1), passes_per_step=s.integer("passes_per_step", 1, 1))


_COMPONENT_KEYS = (
    "path", "offload", "layers", "prefetch", "size", "lora_targets", "dtype", "load",
)


def _resolve_path(origin: ConfigOrigin, key: str, text: Any) -> str:
    if not isinstance(text, str) or not text.strip():
        raise origin.error(key, f"expected a path, found {kind(text)}")
    path = os.path.expanduser(text.strip())
    if not os.path.isabs(path):
        path = os.path.join(os.path.dirname(os.path.abspath(origin.path)), path)
    return os.path.normpath(path)


def _component(origin: ConfigOrigin, name: str, data: Any) -> ComponentConfig:
    s = Section(origin, f"components.{name}", data, _COMPONENT_KEYS)
    offload = s.choice("offload", OFFLOAD_MODES, None)
    if s.has("path") == s.has("size"):
        raise origin.error(
            s.key, "give either path (a checkpoint) or size (declared sizes, to plan without the weights)"
        )
    path = _resolve_path(origin, s.sub("path"), s.get("path")) if s.has("path") else None
    if path is not None and not os.path.exists(path):
        raise origin.error(
            s.sub("path"),
            f"{path} does not exist; fix the path (relative paths start at the config's folder), "
            "write the checkpoint first, or declare size/layers instead",
        )
    pattern, count = _layers(s, offload, declared=path is None)
    target_bytes, target_patterns = _lora_targets(s, declared=path is None)
    size = s.size("size")
    if size is not None and target_bytes is not None and target_bytes > size:
        raise origin.error(s.sub("lora_targets"), f"{s.get('lora_targets')!r} exceeds size {s.get('size')!r}")
    return ComponentConfig(
        name=name,
        offload=offload,
        path=path,
        layer_pattern=pattern,
        layer_count=count,
        size=size,
        lora_target_bytes=target_bytes,
        lora_target_patterns=target_patterns,
        dtype=s.choice("dtype", DTYPES, None) if s.has("dtype") else None,
        load=s.choice("load", LOAD_MODES, "mapped"),
        prefetch=s.integer("prefetch", 1, 0),
    )


def _layers(s: Section, offload: str, declared: bool) -> tuple[str | None, int | None]:
    """``layers`` is a name pattern (``"blocks.{i}."``) with a checkpoint, a count when declared."""
    value = s.get("layers")
    if value is None:
        if offload == "layerwise":
            need = "a count such as 208" if declared else 'a pattern such as "blocks.{i}."'
            raise s.origin.error(s.sub("layers"), f"missing; a layerwise component needs {need}")
        return None, None
    if declared:
        return None, s.integer("layers", None, 1)
    if not isinstance(value, str) or value.count("{i}") != 1:
        raise s.origin.error(
            s.sub("layers"), f"{value!r} is not a layer pattern; write one with a single {{i}}, e.g. \"blocks.{{i}}.\""
        )
    return value, None


def _lora_targets(s: Section, declared: bool) -> tuple[int | None, tuple[str, ...]]:
    """A size (bytes of merged weights) or, with a checkpoint, glob patterns of tensor names."""
    value = s.get("lora_targets")
    if value is None:
        return None, ()
    if isinstance(value, list):
        if declared or not value or not all(isinstance(v, str) and v for v in value):
            need = "a size (declared components have no tensor names)" if declared else "non-empty name patterns"
            raise s.origin.error(s.sub("lora_targets"), f"expected {need}, e.g. 38GB or [\"*.attn.*.weight\"]")
        return None, tuple(value)
    return s.size("lora_targets"), ()


def _components(origin: ConfigOrigin, data: Any) -> dict[str, ComponentConfig]:
    if not isinstance(data, dict) or not data:
        raise origin.error("components", "missing or empty; name at least one component (dit, text_encoder, ...)")
    out = {}
    for name, body in data.items():
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_\-]*", name):
            raise origin.error(f"components.{name}", "a component name is a word such as dit or text_encoder")
        out[name] = _component(origin, name, body)
    streamed = [c.name for c in out.values() if c.offload == "layerwise"]
    if len(streamed) > 1:
        raise origin.error(
            f"components.{streamed[1]}.offload",
            f"only one component may stream layer by layer ({', '.join(streamed)} do); set offload: full on the others",
        )
    return out


_ADAPTER_KEYS = ("path", "strength", "alpha", "rules", "strict", "rslora")


def _number(origin: ConfigOrigin, a: Section, key: str, default):
    value = a.get(key, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise origin.error(a.sub(key), f"{value!r} is not a number")
    return None if value is None else float(value)


def _flag(origin: ConfigOrigin, a: Section, key: str, default):
    value = a.get(key, default)
    if value is not None and not isinstance(value, bool):
        raise origin.error(a.sub(key), f"{value!r} is not true or false")
    return value


def _rules(origin: ConfigOrigin, a: Section) -> tuple:
    rules = a.get("rules", [])
    ok = isinstance(rules, list) and all(
        isinstance(r, dict) and set(r) == {"match", "replace"} and all(isinstance(v, str) for v in r.values())
        for r in rules
    )
    if not ok:
        raise origin.error(a.sub("rules"), "expected a list of {match: REGEX, replace: MODULE_NAME}")
    for rule in rules:
        try:
            re.compile(rule["match"])
        except re.error as exc:
            raise origin.error(a.sub("rules"), f"{rule['match']!r} is not a regular expression ({exc})") from None
    return tuple(dict(r) for r in rules)


def _adapter(origin: ConfigOrigin, a: Section) -> AdapterConfig:
    return AdapterConfig(
        path=_resolve_path(origin, a.sub("path"), a.require("path", "name the adapter file")),
        strength=_number(origin, a, "strength", 1.0),
        alpha=_number(origin, a, "alpha", None),
        rules=_rules(origin, a),
        strict=_flag(origin, a, "strict", True),
        rslora=_flag(origin, a, "rslora", None),
    )


def _lora(origin: ConfigOrigin, data: Any, components: Mapping[str, ComponentConfig]) -> LoraConfig | None:
    if data is None:
        return None
    s = Section(origin, "lora", data, ("adapters", "cache", "component"))
    adapters = []
    raw = s.get("adapters", [])
    if not isinstance(raw, list):
        raise origin.error("lora.adapters", f"expected a list of {{path, strength}}, found {kind(raw)}")
    for i, item in enumerate(raw):
        adapters.append(_adapter(origin, Section(origin, f"lora.adapters[{i}]", item, _ADAPTER_KEYS)))
    component = s.get("component")
    if component is not None and component not in components:
        raise origin.error("lora.component", f"{component!r} is not a component; choose one of {', '.join(components)}")
    return LoraConfig(adapters=tuple(adapters), cache=_lora_cache(origin, s.get("cache")), component=component)


def _lora_cache(origin: ConfigOrigin, data: Any) -> LoraCacheConfig:
    s = Section(origin, "lora.cache", data, ("root", "enabled", "max_size"))
    enabled = s.get("enabled", True)
    if not isinstance(enabled, bool):
        raise origin.error("lora.cache.enabled", f"{enabled!r} is not true or false")
    root = _resolve_path(origin, "lora.cache.root", s.get("root")) if s.has("root") else None
    return LoraCacheConfig(root=root, enabled=enabled, max_size=s.size("max_size"))


# ---------------------------------------------------------------- entry points


def _apply_overrides(data: dict, environ: Mapping[str, str]) -> dict[str, str]:
    """Write ``HOSTMEM_*`` values into ``data``; return ``{key: variable}`` of those used."""
    used = {}
    for variable, key in ENV_OVERRIDES.items():
        value = environ.get(variable)
        if value is None or value.strip() == "":
            continue
        section, name = key.split(".")
        if not isinstance(data.get(section), dict):
            data[section] = {}
        data[section][name] = value.strip()
        used[key] = variable
    return used


_TOP_KEYS = ("deployment", "host", "device", "transfer", "workload", "components", "lora")


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
    components = _components(origin, data.get("components"))
    return DeploymentConfig(
        deployment=name,
        host=_host(origin, data.get("host")),
        device=_device(origin, data.get("device")),
        transfer=_transfer(origin, data.get("transfer")),
        workload=_workload(origin, data.get("workload")),
        components=components,
        lora=_lora(origin, data.get("lora"), components),
        origin=origin,
    )


def load_config(path: str | os.PathLike, environ: Mapping[str, str] | None = None) -> DeploymentConfig:
    """Read and validate a deployment config; ``environ`` defaults to ``os.environ``."""
    path = os.fspath(path)
    try:
        with open(path, "r", encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        raise ConfigError(path, "", "no such config file") from None
    except IsADirectoryError:
        raise ConfigError(path, "", "is a folder; name a .yaml file") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(path, "", f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return parse_config(text, path, environ)
