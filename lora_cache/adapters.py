"""Adapter files of the formats people ship, read into one normalized form.

Every format names the same few parts of a module's change with its own suffixes:

- peft / diffusers: ``<prefix>.<module>.lora_A.weight`` (down) and ``.lora_B.weight`` (up),
  rank and alpha from ``adapter_config.json`` (``r``, ``lora_alpha``, ``rank_pattern``,
  ``alpha_pattern``, ``use_rslora``) or a per-key ``.alpha``;
- kohya / sd-scripts: ``lora_unet_<module_with_underscores>.lora_down.weight``,
  ``.lora_up.weight`` and ``.alpha``;
- ComfyUI / lightx2v: ``diffusion_model.<module>.lora_down.weight``, ``.lora_up.weight``,
  ``.alpha``, and full deltas ``.diff`` (weight) and ``.diff_b`` (bias).

:func:`read_adapter` strips those suffixes and groups the parts by key stem into
:class:`ModuleChange` records; which model module a stem names is decided in
:mod:`lora_cache.keys`. Tensors stay views of a read-only mapping of the file.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

import torch

from hostmem.safetensors_map import SafetensorsError, load_readonly

from .merge_math import refuse_unsupported

__all__ = ["Adapter", "AdapterFile", "AdapterError", "ModuleChange", "as_adapter", "read_adapter"]

# Suffix -> role, longest first so "lora_down.weight" wins over a bare "weight".
_ROLES = (
    ("lora_A.weight", "down"),
    ("lora_down.weight", "down"),
    ("lora_B.weight", "up"),
    ("lora_up.weight", "up"),
    ("diff_b", "diff_b"),
    ("alpha", "alpha"),
    ("diff", "diff"),
)
_KNOWN_PARTS = "lora_A/lora_B.weight, lora_down/lora_up.weight, alpha, diff, diff_b"


class AdapterError(ValueError):
    """An adapter file cannot be read as LoRA; the message names the file and key."""


@dataclass(frozen=True)
class Adapter:
    """What a user asks for: an adapter file and how to apply it.

    ``alpha`` overrides the file's alpha for every module; ``rules`` are extra key rules
    (``[(regex, replacement), ...]`` or ``[{"match": ..., "replace": ...}]``) tried before
    the built-in prefixes; ``strict=False`` turns keys that match no module into a
    warning; ``rslora`` overrides the file's ``use_rslora``.
    """

    path: str
    strength: float = 1.0
    alpha: float | None = None
    rules: tuple = ()
    strict: bool = True
    rslora: bool | None = None

    def __post_init__(self):
        object.__setattr__(self, "path", os.fspath(self.path))
        object.__setattr__(self, "rules", tuple(self.rules or ()))


def as_adapter(spec) -> Adapter:
    """Accept an :class:`Adapter`, a path, a ``(path, strength)`` tuple or a config dict."""
    if isinstance(spec, Adapter):
        return spec
    if isinstance(spec, (str, os.PathLike)):
        return Adapter(spec)
    if isinstance(spec, tuple) and len(spec) == 2:
        return Adapter(spec[0], float(spec[1]))
    if isinstance(spec, dict):
        unknown = set(spec) - {"path", "strength", "alpha", "rules", "strict", "rslora"}
        if unknown or "path" not in spec:
            raise AdapterError(
                f"adapter entry {spec!r}: needs 'path' and may have strength, alpha, rules, strict, "
                f"rslora{'; unknown: ' + ', '.join(sorted(unknown)) if unknown else ''}"
            )
        return Adapter(**spec)
    raise AdapterError(
        f"adapter {spec!r}: give a path, a (path, strength) tuple, a dict or lora_cache.Adapter"
    )


@dataclass
class ModuleChange:
    """One module's change in an adapter file, under the file's own key stem."""

    stem: str
    parts: dict[str, torch.Tensor] = field(default_factory=dict)  # role -> tensor
    keys: dict[str, str] = field(default_factory=dict)  # role -> key in the file

    @property
    def rank(self) -> int | None:
        down = self.parts.get("down")
        return None if down is None else int(down.shape[0])

    @property
    def stored_alpha(self) -> float | None:
        alpha = self.parts.get("alpha")
        return None if alpha is None else float(alpha.float().reshape(-1)[0])


@dataclass(frozen=True)
class PeftConfig:
    """The fields of ``adapter_config.json`` that decide a module's scale."""

    r: int | None = None
    lora_alpha: float | None = None
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)
    use_rslora: bool = False

    @staticmethod
    def _lookup(patterns: dict, stem: str):
        # peft matches a pattern against the end of the module's full dotted name.
        for pattern, value in patterns.items():
            if re.fullmatch(rf"(.*\.)?(?:{pattern})", stem):
                return value
        return None

    def rank_for(self, stem: str) -> int | None:
        found = self._lookup(self.rank_pattern, stem)
        return self.r if found is None else int(found)

    def alpha_for(self, stem: str) -> float | None:
        found = self._lookup(self.alpha_pattern, stem)
        return self.lora_alpha if found is None else float(found)


@dataclass
class AdapterFile:
    """An adapter file read into :class:`ModuleChange` records, by key stem."""

    path: str
    format: str
    modules: dict[str, ModuleChange]
    config: PeftConfig | None = None

    def alpha(self, change: ModuleChange) -> float | None:
        """The alpha the file gives a module: its ``.alpha`` key, else the peft config."""
        if change.stored_alpha is not None:
            return change.stored_alpha
        return None if self.config is None else self.config.alpha_for(change.stem)

    def rank(self, change: ModuleChange) -> int | None:
        """The module's rank (the down matrix's rows), checked against the peft config."""
        rank = change.rank
        expected = None if self.config is None or rank is None else self.config.rank_for(change.stem)
        if expected is not None and expected != rank:
            raise AdapterError(
                f"{self.path}: {change.keys['down']!r} has rank {rank} but adapter_config.json "
                f"says r={expected} for it; fix r/rank_pattern or use the matching config"
            )
        return rank

    @property
    def rslora(self) -> bool:
        return bool(self.config and self.config.use_rslora)


def _split_key(key: str) -> tuple[str, str] | None:
    for suffix, role in _ROLES:
        if key.endswith("." + suffix):
            return key[: -len(suffix) - 1], role
    return None


def _read_peft_config(folder: str) -> PeftConfig | None:
    path = os.path.join(folder, "adapter_config.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            raw = json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{path}: cannot read the adapter config ({exc})") from None
    if raw.get("use_dora"):
        raise AdapterError(
            f"{path}: use_dora is true; lora_cache does not merge DoRA adapters (the magnitude "
            "vectors make the merge more than W + scale * B @ A)"
        )
    return PeftConfig(
        r=raw.get("r"),
        lora_alpha=raw.get("lora_alpha"),
        rank_pattern=raw.get("rank_pattern") or {},
        alpha_pattern=raw.get("alpha_pattern") or {},
        use_rslora=bool(raw.get("use_rslora", False)),
    )


def _detect_format(keys: list[str]) -> str:
    if any(k.startswith(("lora_unet_", "lora_te", "lora_transformer_")) for k in keys):
        return "kohya"
    if any(k.startswith(("diffusion_model.", "model.diffusion_model.")) for k in keys):
        return "comfyui"
    if any(".lora_A." in k for k in keys):
        return "peft"
    return "lora"


def _resolve_file(path: str) -> str:
    """A peft folder stands for the ``adapter_model.safetensors`` in it."""
    if os.path.isdir(path):
        inner = os.path.join(path, "adapter_model.safetensors")
        if not os.path.exists(inner):
            raise AdapterError(f"{path}: a folder without adapter_model.safetensors; name the .safetensors file")
        return inner
    return path


def read_adapter(path: str | os.PathLike) -> AdapterFile:
    """Read an adapter file (or a peft folder) into its normalized form.

    Every key must be a LoRA part this merge understands; a key of an unsupported
    variant (DoRA, LoHa, ...) or an unknown key is an error naming it, never skipped.
    """
    path = _resolve_file(os.fspath(path))
    try:
        tensors = load_readonly(path)
    except SafetensorsError as exc:
        raise AdapterError(f"adapter {exc}") from None
    modules: dict[str, ModuleChange] = {}
    for key in sorted(tensors):
        refuse_unsupported(path, key)
        split = _split_key(key)
        if split is None:
            raise AdapterError(f"{path}: key {key!r} is not a LoRA part this merge understands ({_KNOWN_PARTS})")
        stem, role = split
        change = modules.setdefault(stem, ModuleChange(stem))
        change.parts[role] = tensors[key]
        change.keys[role] = key
    for change in modules.values():
        _check_pairs(path, change)
    return AdapterFile(path, _detect_format(list(tensors)), modules, _read_peft_config(os.path.dirname(path)))


def _check_pairs(path: str, change: ModuleChange) -> None:
    """A down without its up (or the reverse), or ranks that disagree, is a broken file."""
    up, down = change.parts.get("up"), change.parts.get("down")
    if (up is None) != (down is None):
        have, lacking = ("up", "down") if down is None else ("down", "up")
        raise AdapterError(f"{path}: {change.keys[have]!r} has no matching {lacking} matrix (truncated adapter?)")
    if up is not None and (up.dim() < 2 or down.dim() < 2 or up.shape[1] != down.shape[0]):
        raise AdapterError(
            f"{path}: {change.keys['up']!r} {tuple(up.shape)} and {change.keys['down']!r} "
            f"{tuple(down.shape)} do not multiply (rank mismatch)"
        )
    if up is None and "diff" not in change.parts and "diff_b" not in change.parts:
        raise AdapterError(f"{path}: {change.keys['alpha']!r} has no lora_up/lora_down or diff beside it")
