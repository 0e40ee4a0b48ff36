"""What a user asks for: which adapter file, how strongly, with which overrides.

The numbers here scale every merged weight, so a NaN or an infinite strength or alpha
would poison the whole model without any error; they are refused where they are given.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from hostmem.errors import HostmemError
from hostmem.units import FLOAT32_MAX

__all__ = ["Adapter", "AdapterError", "UnsupportedAdapterError", "as_adapter", "as_adapters"]

_SPEC_KEYS = {"path", "strength", "alpha", "rules", "strict", "rslora", "convert"}
_CONVERTERS = ("auto", "native", "diffusers")


class AdapterError(HostmemError, ValueError):
    """An adapter file cannot be read as LoRA; the message names the file and key."""


class UnsupportedAdapterError(HostmemError, ValueError):
    """An adapter uses a variant this merge cannot reproduce; the message names the key."""


def _finite(path: str, what: str, value) -> float:
    if isinstance(value, (str, bytes, bool)):  # "1.0" or True: a config's quoting slip, as the config refuses it
        raise AdapterError(f"adapter {path}: {what} {value!r} is {type(value).__name__}, not a number; "
                           f"give it as a number (1.0 applies it fully)")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise AdapterError(f"adapter {path}: {what} {value!r} is not a number") from None
    if not math.isfinite(number):
        raise AdapterError(f"adapter {path}: {what} is {value!r}; give a finite number (1.0 applies it fully)")
    if abs(number) > FLOAT32_MAX:
        raise AdapterError(f"adapter {path}: {what} {number:g} is beyond float32's range ({FLOAT32_MAX:.1e}), which "
                           "the merge computes in; give a number of sensible size (1.0 applies it fully)")
    return number


@dataclass(frozen=True)
class Adapter:
    """An adapter file and how to apply it.

    ``alpha`` overrides every alpha the file stores; ``rules`` are extra key rules
    (``[(regex, replacement), ...]`` or ``[{"match": ..., "replace": ...}]``) tried before
    the built-in prefixes, where a replacement may be a list of modules (a LoRA on a fused
    projection, split by rows) or end in ``[start:stop]`` (rows of a fused weight);
    ``strict=False`` turns keys that match no module into a warning; ``rslora`` overrides
    the file's ``use_rslora``. ``convert`` says who turns the file's keys into the model's:
    ``"auto"`` (diffusers' own converter for a diffusers model, else this package's
    reader), ``"native"`` (always this package's reader) or ``"diffusers"``.
    """

    path: str
    strength: float = 1.0
    alpha: float | None = None
    rules: tuple = ()
    strict: bool = True
    rslora: bool | None = None
    convert: str = "auto"

    def __post_init__(self):
        path = os.fspath(self.path)
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "rules", tuple(self.rules or ()))
        object.__setattr__(self, "strength", _finite(path, "strength", self.strength))
        if self.alpha is not None:
            object.__setattr__(self, "alpha", _finite(path, "alpha", self.alpha))
        if self.convert not in _CONVERTERS:
            raise AdapterError(f"adapter {path}: convert {self.convert!r}; expected one of {', '.join(_CONVERTERS)}")


def as_adapters(adapters) -> list[Adapter]:
    """Accept a list of what :func:`as_adapter` takes, or one of them alone: a bare path
    (``merge(model, "style.safetensors")``) is one adapter, never a string of them."""
    one = isinstance(adapters, (str, os.PathLike, Adapter, dict)) or (  # or (path, strength): not two adapters
        isinstance(adapters, tuple) and len(adapters) == 2 and isinstance(adapters[0], (str, os.PathLike))
        and not isinstance(adapters[1], (str, os.PathLike, Adapter, dict, tuple, list)))
    if one:
        return [as_adapter(adapters)]
    try:
        items = list(adapters)
    except TypeError:
        raise AdapterError(
            f"adapters {adapters!r}: give a path, a (path, strength) tuple, a dict, lora_cache.Adapter, "
            "or a list of them"
        ) from None
    return [as_adapter(a) for a in items]


def as_adapter(spec) -> Adapter:
    """Accept an :class:`Adapter`, a path, a ``(path, strength)`` tuple or a config dict."""
    if isinstance(spec, Adapter):
        return spec
    if isinstance(spec, (str, os.PathLike)):
        return Adapter(spec)
    if isinstance(spec, tuple) and len(spec) == 2:
        return Adapter(spec[0], spec[1])
    if isinstance(spec, dict):
        unknown = set(spec) - _SPEC_KEYS
        if unknown or "path" not in spec:
            raise AdapterError(
                f"adapter entry {spec!r}: needs 'path' and may have strength, alpha, rules, strict, "
                f"rslora, convert{'; unknown: ' + ', '.join(sorted(unknown)) if unknown else ''}"
            )
        return Adapter(**spec)
    raise AdapterError(
        f"adapter {spec!r}: give a path, a (path, strength) tuple, a dict or lora_cache.Adapter"
    )
