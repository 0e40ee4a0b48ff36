"""Config files as data with a source map: YAML with the line of every key, read with good errors.

PyYAML's loader forgets where a value came from once it builds Python objects; the
composed node tree still knows. :func:`load_yaml_with_lines` keeps both, and
:class:`Section` reads one mapping field by field so that every problem becomes a
:class:`ConfigError` naming the file, the key and its line.
"""

from __future__ import annotations

import math
import os
import re
from types import MappingProxyType
from typing import Any, Mapping, NamedTuple

import yaml

from hostmem.errors import HostmemError
from hostmem.units import FLOAT32_MAX, parse_size

__all__ = ["ConfigError", "ConfigOrigin", "Section", "load_yaml_with_lines", "kind", "resolve_path"]


class ConfigError(HostmemError, ValueError):
    """A config problem: ``str()`` reads ``FILE:LINE: KEY: problem; what to do``."""

    def __init__(self, where: str, key: str, problem: str):
        self.where, self.key, self.problem = where, key, problem
        super().__init__(f"{where}: {key}: {problem}" if key else f"{where}: {problem}")


class ConfigOrigin(NamedTuple):
    """Where each key came from: its line in the file, or an environment variable."""

    path: str
    lines: Mapping[str, int] = MappingProxyType({})  # read-only: one default serves every origin
    overrides: Mapping[str, str] = MappingProxyType({})

    def where(self, key: str) -> str:
        """``FILE:LINE`` of ``key`` (the nearest enclosing key that has a line)."""
        if key in self.overrides:
            return f"{self.overrides[key]} (overrides {key} of {self.path})"
        probe = key
        while probe:
            if probe in self.lines:
                return f"{self.path}:{self.lines[probe]}"
            probe = probe.rpartition(".")[0]
        return self.path

    def error(self, key: str, problem: str) -> ConfigError:
        return ConfigError(self.where(key), key, problem)


# ---------------------------------------------------------------- YAML with lines


def _line_map(node: yaml.Node, prefix: str, lines: dict[str, int], origin_path: str) -> None:
    """Record the 1-based line of every key under ``node``; reject duplicate keys."""
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
            if key in lines:
                raise ConfigError(
                    f"{origin_path}:{key_node.start_mark.line + 1}", key,
                    f"given twice (first on line {lines[key]}); keep one",
                )
            lines[key] = key_node.start_mark.line + 1
            _line_map(value_node, key, lines, origin_path)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            key = f"{prefix}[{i}]"
            lines[key] = item.start_mark.line + 1
            _line_map(item, key, lines, origin_path)


_MAX_DEPTH = 32  # a deployment config nests four levels; far deeper is not a config


class PlainExponent(str):
    """An unquoted scalar written as a number with an exponent and no dot (``1e-3``): YAML 1.1
    leaves it a string, YAML 1.2 and JSON read a number. It stays the string it is (a
    deployment named ``1e5``, a file of that name), and :meth:`Section.number` reads it as
    the number; a quoted ``'1e-3'`` is a plain string, refused as ``'0.8'`` is."""


_EXPONENT_TAG = "tag:hostmem,2026:plain-exponent"


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """The safe loader, marking unquoted exponent numbers (:class:`PlainExponent`)."""


_Loader.add_implicit_resolver(
    _EXPONENT_TAG, re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"), list("-+0123456789."))
_Loader.add_constructor(_EXPONENT_TAG, lambda loader, node: PlainExponent(node.value))


def _refuse_aliases(text: str, path: str) -> None:
    """Refuse YAML aliases (``*name``) and absurd nesting, before anything is composed.

    An alias can refer to itself (an endless tree) or nest so that 256 bytes expand to
    billions of nodes, and the line map and the config would walk every expansion. A
    deployment config has no need of either, so the parser's events are scanned first
    (linear in the text: nothing is expanded) and the first alias is an error at its line.
    """
    depth = 0
    loader = _Loader(text)
    try:
        while (event := loader.get_event()) is not None:
            line = event.start_mark.line + 1
            if isinstance(event, yaml.AliasEvent):
                raise ConfigError(
                    f"{path}:{line}", "",
                    f"alias *{event.anchor} is not accepted in configs (aliases can expand without end); "
                    "write the value out",
                )
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > _MAX_DEPTH:
                    raise ConfigError(f"{path}:{line}", "", f"nested more than {_MAX_DEPTH} levels deep; not a deployment config")
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
    finally:
        loader.dispose()


def load_yaml_with_lines(text: str, path: str) -> tuple[Any, dict[str, int]]:
    """The document in ``text`` and the line of every key (``host.limit``, ``lora.adapters[0]``).

    Aliases are refused (:func:`_refuse_aliases`) before the document is composed.
    """
    loader = _Loader(text)
    try:
        _refuse_aliases(text, path)
        node = loader.get_single_node()
        lines: dict[str, int] = {}
        if node is not None:
            _line_map(node, "", lines, path)
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}" if mark else path
        raise ConfigError(where, "", f"not valid YAML: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(path, "", f"not valid YAML: {exc}") from None
    finally:
        loader.dispose()
    return data, lines


# ---------------------------------------------------------------- field readers


class Section:
    """A mapping of the config under ``key``, read field by field with good errors."""

    def __init__(self, origin: ConfigOrigin, key: str, data: Any, known: tuple[str, ...]):
        self.origin, self.key = origin, key
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise origin.error(key, f"expected a mapping of {', '.join(known)}, found {kind(data)}")
        for name in data:
            if name not in known:
                import difflib  # here: only a misspelt key needs it

                hint = difflib.get_close_matches(str(name), known, n=1)
                advice = f"did you mean {hint[0]!r}?" if hint else f"known keys: {', '.join(known)}"
                raise origin.error(self.sub(name), f"unknown key; {advice}")
        self.data = data

    def sub(self, name: str) -> str:
        return f"{self.key}.{name}" if self.key else str(name)

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def get(self, name: str, default: Any = None) -> Any:
        value = self.data.get(name)
        return default if value is None else value

    def parsed(self, name: str, parse, default: Any = None, advice: str = "") -> Any:
        """``parse(value)`` of a field; a ValueError becomes a ConfigError on the field."""
        if not self.has(name):
            return default
        try:
            return parse(self.data[name])
        except ValueError as exc:
            raise self.origin.error(self.sub(name), f"{exc}{'; ' + advice if advice else ''}") from None

    def size(self, name: str, default: int | None = None) -> int | None:
        return self.parsed(name, parse_size, default)

    def integer(self, name: str, default: int | None, minimum: int, maximum: int = 1_000_000) -> int | None:
        """A whole number in ``[minimum, maximum]``: counts of steps, layers, prefetched layers.

        The upper bound keeps a typo (a 400-digit count) out of the plan's arithmetic.
        """
        value = self.get(name, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
            raise self.origin.error(
                self.sub(name), f"{short(value)} is not a whole number from {minimum} to {maximum:,}"
            )
        return value

    def number(self, name: str, default: float | None) -> float | None:
        """A finite number within float32's range, which the merge computes in (``strength:
        0.8``, ``1e-3``: see :class:`PlainExponent`); NaN, infinities and bools are refused."""
        value = self.get(name, default)
        if value is None:
            return None
        if isinstance(value, PlainExponent):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.origin.error(self.sub(name), f"{short(value)} is not a number")
        try:
            number = float(value)
        except OverflowError:
            number = float("inf")
        if not math.isfinite(number):
            beyond = " (.inf, or a number written beyond a float's range)" if math.isinf(number) else ""
            raise self.origin.error(self.sub(name), f"{short(value)} is not a finite number{beyond}")
        if abs(number) > FLOAT32_MAX:
            raise self.origin.error(self.sub(name), f"{number:g} is beyond float32's range ({FLOAT32_MAX:.1e}), which "
                                    "the merge computes in; give a number of sensible size")
        return number

    def choice(self, name: str, choices: tuple[str, ...], default: str | None) -> str:
        value = self.get(name, default)
        if value is None:
            raise self.origin.error(self.sub(name), f"missing; choose one of {', '.join(choices)}")
        if value not in choices:
            raise self.origin.error(self.sub(name), f"{value!r} is not one of {', '.join(choices)}")
        return value

    def require(self, name: str, advice: str) -> Any:
        if not self.has(name):
            raise self.origin.error(self.sub(name), f"missing; {advice}")
        return self.data[name]


def short(value: Any) -> str:
    """``repr(value)``, cut short: a 400-digit typo need not be echoed whole."""
    shown = repr(value)
    return shown if len(shown) <= 40 else f"{shown[:30]}...({len(shown)} characters)"


def kind(value: Any) -> str:
    return "nothing" if value is None else f"{type(value).__name__} {value!r}"[:60]


def resolve_path(origin: ConfigOrigin, key: str, text: Any) -> str:
    """``text`` as an absolute path; a relative one starts at the config file's folder."""
    if not isinstance(text, str) or not text.strip():
        raise origin.error(key, f"expected a path, found {kind(text)}")
    path = os.path.expanduser(text.strip())
    if not os.path.isabs(path):
        path = os.path.join(os.path.dirname(os.path.abspath(origin.path)), path)
    return os.path.normpath(path)
