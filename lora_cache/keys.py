"""Which model parameter each adapter key changes.

An adapter names modules the way its trainer saw them: with a wrapper prefix
(``base_model.model.``, ``transformer.``, ``diffusion_model.``), or kohya-style with the
dots turned into underscores (``lora_unet_blocks_0_attn_to_q``), which is ambiguous on
its own (``to_q`` has an underscore too) and is therefore resolved against the model's
real module names. Rules from the config (regex -> replacement) are tried first.

Resolution works on names and shapes only (``{parameter name: shape}``), so the same code
serves a loaded model and a checkpoint's headers (the planner's provider).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

from .adapters import Adapter, AdapterFile, ModuleChange
from .merge_math import Delta, lora_scale

__all__ = ["KeyResolutionError", "KeyRule", "ModuleIndex", "plan_deltas", "resolve_adapter"]

_DOTTED_PREFIXES = (
    "base_model.model.",
    "model.diffusion_model.",
    "diffusion_model.",
    "transformer.",
    "unet.",
    "model.",
)
_KOHYA_PREFIXES = ("lora_unet_", "lora_transformer_", "lora_te1_", "lora_te2_", "lora_te_", "lycoris_")
_SHOWN = 20
_HOW_TO_FIX = (
    "Add a key rule that maps them to module names (config: lora.adapters[N].rules: "
    "[{match: '<regex on the key without its .lora_A/.lora_down/.alpha/.diff suffix>', "
    "replace: '<module name>'}]; Python: lora_cache.Adapter(path, rules=[(regex, replacement)])), "
    "or set strict: false to skip them with a warning."
)


class KeyResolutionError(ValueError):
    """Adapter keys that match no module, match several, or do not fit their parameter."""


@dataclass(frozen=True)
class KeyRule:
    """A user's rule: a key stem matching ``pattern`` names ``pattern.sub(replace, stem)``."""

    pattern: re.Pattern
    replace: str

    @classmethod
    def parse(cls, spec) -> "KeyRule":
        """Accept ``(regex, replacement)`` or ``{"match": regex, "replace": replacement}``."""
        if isinstance(spec, KeyRule):
            return spec
        if isinstance(spec, dict) and set(spec) == {"match", "replace"}:
            spec = (spec["match"], spec["replace"])
        if not (isinstance(spec, (tuple, list)) and len(spec) == 2):
            raise KeyResolutionError(
                f"key rule {spec!r}: expected {{match: REGEX, replace: MODULE_NAME}} or (regex, replacement)"
            )
        try:
            return cls(re.compile(spec[0]), str(spec[1]))
        except re.error as exc:
            raise KeyResolutionError(f"key rule {spec[0]!r}: not a regular expression ({exc})") from None


class ModuleIndex:
    """The model's parameters, grouped by owning module, with kohya's spellings of them.

    ``shapes`` maps qualified parameter names (``blocks.0.attn.to_q.weight``, or
    ``dit.blocks.0...`` for a dict of components) to shapes; ``components`` lists the
    component names that prefix them, so an adapter key can name a module without it.
    """

    def __init__(self, shapes: dict[str, tuple[int, ...]], components: tuple[str, ...] = ()):
        self.shapes = dict(shapes)
        self.components = tuple(components)
        self.modules = {name.rpartition(".")[0] for name in self.shapes}
        self._underscored: dict[str, list[str]] = {}
        for module in sorted(self.modules):
            self._underscored.setdefault(self._bare(module).replace(".", "_"), []).append(module)

    def _bare(self, module: str) -> str:
        head, _, rest = module.partition(".")
        return rest if head in self.components and rest else module

    @staticmethod
    def _unique(found: list[str]) -> str | None:
        if len(found) > 1:
            raise KeyResolutionError(f"could name any of {found}; add a key rule that picks one")
        return found[0] if found else None

    def find(self, name: str) -> str | None:
        """The module ``name`` names: exactly, or inside exactly one component."""
        if name in self.modules:
            return name
        return self._unique([f"{c}.{name}" for c in self.components if f"{c}.{name}" in self.modules])

    def find_kohya(self, underscored: str) -> str | None:
        """The module whose dotted name, with dots as underscores, is ``underscored``."""
        return self._unique(self._underscored.get(underscored, []))

    def examples(self, count: int = 3) -> list[str]:
        return sorted(self.modules)[:count]


def _find_with_prefixes(name: str, index: ModuleIndex) -> str | None:
    """Try ``name`` as is, then with wrapper prefixes stripped one after another."""
    found = index.find(name)
    while found is None:
        prefix = next((p for p in _DOTTED_PREFIXES if name.startswith(p)), None)
        if prefix is None:
            break
        name = name[len(prefix) :]
        found = index.find(name)
    if found is None and "." not in name:
        prefix = next((p for p in _KOHYA_PREFIXES if name.startswith(p)), "")
        found = index.find_kohya(name[len(prefix) :])
    return found


def resolve_stem(stem: str, rules: list[KeyRule], index: ModuleIndex) -> str | None:
    """The module a key stem names: the first rule that matches decides, else the prefixes."""
    for rule in rules:
        if rule.pattern.search(stem):
            return _find_with_prefixes(rule.pattern.sub(rule.replace, stem), index)
    return _find_with_prefixes(stem, index)


def _unmatched_message(path: str, keys: list[str], index: ModuleIndex) -> str:
    shown = "\n".join(f"  {k}" for k in keys[:_SHOWN])
    more = f"\n  ... and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
    return (
        f"{path}: {len(keys)} adapter key(s) match no module of the model:\n{shown}{more}\n"
        f"The model's modules look like: {', '.join(index.examples())}.\n{_HOW_TO_FIX}"
    )


def resolve_adapter(adapter: AdapterFile, spec: Adapter, index: ModuleIndex) -> dict[str, ModuleChange]:
    """Map each module change of ``adapter`` to a model module name.

    Unmatched keys raise :class:`KeyResolutionError` (first 20 and a count), or warn and are
    skipped when ``spec.strict`` is false. Two keys that land on one module are an error.
    """
    rules = [KeyRule.parse(r) for r in spec.rules]
    resolved: dict[str, ModuleChange] = {}
    unmatched: list[str] = []
    for stem, change in adapter.modules.items():
        first_key = next(iter(change.keys.values()))
        try:
            module = resolve_stem(stem, rules, index)
        except KeyResolutionError as exc:
            raise KeyResolutionError(f"{adapter.path}: adapter key {first_key!r} {exc}") from None
        if module is None:
            unmatched.append(first_key)
        elif module in resolved:
            raise KeyResolutionError(
                f"{adapter.path}: keys {resolved[module].stem!r} and {stem!r} both name module "
                f"{module!r}; remove one or add a key rule that tells them apart"
            )
        else:
            resolved[module] = change
    if unmatched:
        message = _unmatched_message(adapter.path, unmatched, index)
        if spec.strict:
            raise KeyResolutionError(message)
        warnings.warn(message.replace(_HOW_TO_FIX, "strict: false, so they are skipped."), stacklevel=3)
    return resolved


def _check_shape(adapter: AdapterFile, key: str, param: str, delta: Delta, index: ModuleIndex) -> None:
    expected = index.shapes.get(param)
    if expected is None:
        raise KeyResolutionError(f"{adapter.path}: {key!r} changes {param!r}, which the model does not have")
    if tuple(delta.shape) != tuple(expected):
        raise KeyResolutionError(
            f"{adapter.path}: {key!r} gives a change of shape {tuple(delta.shape)} but the model's "
            f"{param!r} has shape {tuple(expected)}; is the adapter made for another model (or size)?"
        )


def _module_deltas(adapter: AdapterFile, spec: Adapter, module: str, change: ModuleChange):
    """Yield ``(parameter, key, Delta)`` for the weight and bias changes of one module."""
    parts, strength = change.parts, spec.strength
    if "up" in parts or "diff" in parts:
        scale = 0.0
        if "up" in parts:
            alpha = spec.alpha if spec.alpha is not None else adapter.alpha(change)
            rslora = adapter.rslora if spec.rslora is None else spec.rslora
            scale = lora_scale(strength, alpha, adapter.rank(change), rslora)
        key = change.keys.get("up", change.keys.get("diff"))
        source = f"{adapter.path}: {key!r}"
        yield f"{module}.weight", key, Delta(
            source, parts.get("up"), parts.get("down"), scale, parts.get("diff"), strength
        )
    if "diff_b" in parts:
        key = change.keys["diff_b"]
        yield f"{module}.bias", key, Delta(f"{adapter.path}: {key!r}", diff=parts["diff_b"], diff_scale=strength)


def plan_deltas(adapters: list[tuple[AdapterFile, Adapter]], index: ModuleIndex) -> dict[str, list[Delta]]:
    """Every changed parameter with its deltas in adapter order, in the model's parameter order."""
    planned: dict[str, list[Delta]] = {}
    for adapter, spec in adapters:
        for module, change in resolve_adapter(adapter, spec, index).items():
            for param, key, delta in _module_deltas(adapter, spec, module, change):
                delta.check()
                _check_shape(adapter, key, param, delta, index)
                planned.setdefault(param, []).append(delta)
    return {name: planned[name] for name in index.shapes if name in planned}
