"""The lora section: adapters (file, strength, overrides, key rules) and the merge cache."""

from __future__ import annotations

import re
from typing import Any, Mapping

from .model import AdapterConfig, ComponentConfig, LoraCacheConfig, LoraConfig
from .source import ConfigOrigin, Section, kind, resolve_path

__all__ = ["parse_lora"]

_ADAPTER_KEYS = ("path", "strength", "alpha", "rules", "strict", "rslora")


def _flag(origin: ConfigOrigin, a: Section, key: str, default):
    value = a.get(key, default)
    if value is not None and not isinstance(value, bool):
        raise origin.error(a.sub(key), f"{value!r} is not true or false")
    return value


def _module_list(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)


def _rules(origin: ConfigOrigin, a: Section) -> tuple:
    rules = a.get("rules", [])
    ok = isinstance(rules, list) and all(
        isinstance(r, dict) and set(r) == {"match", "replace"} and isinstance(r["match"], str)
        and (isinstance(r["replace"], str) or _module_list(r["replace"]))  # a list: a fused projection split
        for r in rules
    )
    if not ok:
        raise origin.error(a.sub("rules"), "expected a list of {match: REGEX, replace: MODULE_NAME or [MODULE_NAME, ...]}")
    for rule in rules:
        try:
            re.compile(rule["match"])
        except re.error as exc:
            raise origin.error(a.sub("rules"), f"{rule['match']!r} is not a regular expression ({exc})") from None
    return tuple(dict(r) for r in rules)


def _adapter(origin: ConfigOrigin, a: Section) -> AdapterConfig:
    return AdapterConfig(
        path=resolve_path(origin, a.sub("path"), a.require("path", "name the adapter file")),
        strength=a.number("strength", 1.0),
        alpha=a.number("alpha", None),
        rules=_rules(origin, a),
        strict=_flag(origin, a, "strict", True),
        rslora=_flag(origin, a, "rslora", None),
    )


def parse_lora(origin: ConfigOrigin, data: Any, components: Mapping[str, ComponentConfig]) -> LoraConfig | None:
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
    if component is not None and (not isinstance(component, str) or component not in components):
        raise origin.error("lora.component", f"{component!r} is not a component; choose one of {', '.join(components)}")
    return LoraConfig(adapters=tuple(adapters), cache=_lora_cache(origin, s.get("cache")), component=component)


def _lora_cache(origin: ConfigOrigin, data: Any) -> LoraCacheConfig:
    s = Section(origin, "lora.cache", data, ("root", "roots", "enabled", "max_size"))
    enabled = s.get("enabled", True)
    if not isinstance(enabled, bool):
        raise origin.error("lora.cache.enabled", f"{enabled!r} is not true or false")
    roots = _cache_roots(origin, s)
    return LoraCacheConfig(root=roots[0] if roots else None, enabled=enabled, max_size=s.size("max_size"), roots=roots)


def _cache_roots(origin: ConfigOrigin, s: Section) -> tuple[str, ...]:
    """``lora.cache.roots`` (an ordered list) or ``lora.cache.root`` (one), as absolute paths."""
    if s.has("root") and s.has("roots"):
        raise origin.error("lora.cache.roots", "give lora.cache.roots or lora.cache.root, not both")
    if s.has("root"):
        return (resolve_path(origin, "lora.cache.root", s.get("root")),)
    if not s.has("roots"):
        return ()
    listed = s.get("roots")
    if not isinstance(listed, list) or not listed:
        raise origin.error("lora.cache.roots", f"expected a non-empty list of folders, found {kind(listed)}")
    return tuple(resolve_path(origin, f"lora.cache.roots[{i}]", r) for i, r in enumerate(listed))
