"""The pure-string half of adapter keys: which module a key stem names.

A key is a stem plus a suffix naming its part (``.lora_A.weight``, ``.lora_down.weight``,
``.alpha``, ``.diff`` ...: the formats' one table, :func:`lora_cache.adapters.formats.split_key`);
the stem names a module the way its trainer saw it (:func:`resolve_stem`, see
:mod:`lora_cache.targets.keys` for the rules). Both work on names and shapes only and import no
torch, so the merge (through :mod:`lora_cache.targets.keys` and the adapter reader) and the
planner's header-only path (:mod:`lora_cache.targets.header_targets`) share one resolver.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from hostmem.errors import HostmemError

__all__ = ["KeyResolutionError", "KeyRule", "ModuleIndex", "Target", "resolve_stem"]

_DOTTED_PREFIXES = (
    "base_model.model.",
    "model.diffusion_model.",
    "diffusion_model.",
    "transformer.",
    "unet.",
    "model.",
)
_KOHYA_PREFIXES = ("lora_unet_", "lora_transformer_", "lora_te1_", "lora_te2_", "lora_te_", "lycoris_")
_KOHYA_TEXT_PREFIXES = ("lora_te_", "lora_te1_", "lora_te2_", "")  # a text encoder's keys, or unprefixed


class KeyResolutionError(HostmemError, ValueError):
    """Adapter keys that match no module, match several, or do not fit their parameter."""


_ROWS = re.compile(r"^(?P<name>.*)\[(?P<start>\d+):(?P<stop>\d+)\]$")
_PART = re.compile(r"^(?P<name>.*)\[(?P<index>\d+)/(?P<count>\d+)\]$")


class Target(NamedTuple):  # a NamedTuple, not a dataclass: the plan's imports stay light
    """Where (part of) an adapter key lands: a module, and optionally rows of its weight,
    named outright or as one of ``count`` equal parts of its rows (resolved against the
    weight's height, so a rule holds at any width)."""

    module: str
    rows: slice | None = None  # rows of the module's weight (and bias) the change covers
    part: tuple[int, int] | None = None  # (index, count): rows index/count .. (index+1)/count of the height


def _target(name: str, index: "ModuleIndex") -> Target | None:
    """The target a rule's replacement names: a module, with ``[start:stop]`` or ``[k/n]``
    rows (None when no module has that name)."""
    rows, part = _ROWS.match(name), _PART.match(name)
    found = _find_with_prefixes((rows or part)["name"] if rows or part else name, index)
    if found is None:
        return None
    return Target(found, slice(int(rows["start"]), int(rows["stop"])) if rows else None,
                  (int(part["index"]), int(part["count"])) if part else None)


class KeyRule(NamedTuple):
    """A user's rule: a key stem matching ``pattern`` names ``pattern.sub(replace, stem)``.

    ``replace`` is one module name, which may end in ``[start:stop]`` to name rows of a
    fused weight (a LoRA on ``to_q`` landing on rows 0:3072 of a fused ``qkv``) or in
    ``[k/n]`` to name part k (from 0) of n equal parts of its rows, or a list of such
    names: a LoRA on a fused projection whose up matrix's rows are split over them in
    order, each taking as many rows as its weight (or its rows, or its part) has. A list
    may name parts of one module out of order: ``[norm_out.linear[1/2],
    norm_out.linear[0/2]]`` swaps the halves of an up matrix (BFL's shift and scale
    against diffusers' scale and shift).
    """

    pattern: re.Pattern
    replace: str | tuple[str, ...]

    @classmethod
    def parse(cls, spec) -> "KeyRule":
        """Accept ``(regex, replacement)`` or ``{"match": regex, "replace": replacement}``."""
        if isinstance(spec, KeyRule):
            return spec
        if isinstance(spec, dict) and set(spec) == {"match", "replace"}:
            spec = (spec["match"], spec["replace"])
        if not (isinstance(spec, (tuple, list)) and len(spec) == 2):
            raise KeyResolutionError(
                f"key rule {spec!r}: expected {{match: REGEX, replace: MODULE_NAME or [MODULE_NAME, ...]}} "
                "or (regex, replacement)"
            )
        replace = spec[1]
        replace = tuple(str(r) for r in replace) if isinstance(replace, (list, tuple)) else str(replace)
        if isinstance(replace, tuple) and not replace:
            raise KeyResolutionError(f"key rule {spec[0]!r}: an empty list of modules to replace with")
        try:
            return cls(re.compile(spec[0]), replace)
        except re.error as exc:
            raise KeyResolutionError(f"key rule {spec[0]!r}: not a regular expression ({exc})") from None

    def apply(self, stem: str, index: "ModuleIndex") -> list[Target] | None:
        """The targets of ``stem`` under this rule (None when a named module is missing)."""
        names = (self.replace,) if isinstance(self.replace, str) else self.replace
        found = [_target(self.pattern.sub(r, stem), index) for r in names]
        return None if None in found else found


class ModuleIndex:
    """The model's parameters, grouped by owning module, with kohya's spellings of them.

    ``shapes`` maps qualified parameter names (``blocks.0.attn.to_q.weight``, or
    ``dit.blocks.0...`` for a dict of components) to shapes; ``components`` lists the
    component names that prefix them, so an adapter key can name a module without it.
    """

    def __init__(self, shapes: dict[str, tuple[int, ...]], components: tuple[str, ...] = (),
                 notes: dict[str, str] | None = None):
        self.shapes = dict(shapes)
        self.components = tuple(components)
        self.notes = dict(notes or {})  # said after a parameter's shape in errors (a shard's whole shape)
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

    def find_parameter(self, name: str) -> str | None:
        """The parameter ``name`` names (without its wrapper prefixes) where it is not a
        module's ``weight`` but a bare parameter (Wan's ``scale_shift_table``, which
        ComfyUI's ``modulation.diff`` changes): exactly, or inside exactly one component."""
        while True:
            if name in self.shapes and not name.endswith((".weight", ".bias")):
                return name
            inner = self._unique([f"{c}.{name}" for c in self.components if f"{c}.{name}" in self.shapes])
            if inner is not None:
                return inner
            prefix = next((p for p in _DOTTED_PREFIXES if name.startswith(p)), None)
            if prefix is None:
                return None
            name = name[len(prefix):]

    def find_kohya(self, underscored: str) -> str | None:
        """The module whose dotted name, with dots as underscores, is ``underscored``."""
        return self._unique(self._underscored.get(underscored, []))

    def examples(self, count: int = 3) -> list[str]:
        """A few module names to show in a message (the root module, named "", is no example)."""
        return sorted(m for m in self.modules if m)[:count]


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
        name = name[len(prefix) :]
        found = index.find_kohya(name)
        if found is None and prefix in _KOHYA_TEXT_PREFIXES:
            found = _only_match(index.find_kohya, _text_model_levels(name, "_", ()))
    elif found is None:
        found = _only_match(index.find, _text_model_levels(name, ".", index.components))
    return found


def _text_model_levels(name: str, sep: str, components: tuple[str, ...]) -> list[str]:
    """``name`` with CLIP's ``text_model`` level taken out, or put in, at its start or right
    after a component's name. transformers 5 flattened ``CLIPTextModel`` (``encoder.layers.0``
    where it was ``text_model.encoder.layers.0``), and most text-encoder LoRAs were written
    before; diffusers' loader drops the level from such keys the same way."""
    level = f"text_model{sep}"
    head, _, rest = name.partition(".")
    spellings = [name.removeprefix(level)] if name.startswith(level) else [level + name]
    if head in components and rest:
        spellings.append(f"{head}.{rest.removeprefix(level)}" if rest.startswith(level) else f"{head}.{level}{rest}")
    return [s for s in spellings if s != name]


def _only_match(find, spellings: list[str]) -> str | None:
    """The module one of the other spellings names, where exactly one does; an ambiguous
    one names none (the key stays unmatched, as it was without this)."""
    found = set()
    for spelling in spellings:
        try:
            found.add(find(spelling))
        except KeyResolutionError:
            return None
    found.discard(None)
    return found.pop() if len(found) == 1 else None


def resolve_stem(stem: str, rules: list[KeyRule], index: ModuleIndex) -> list[Target] | None:
    """Where a key stem lands: the first rule that matches decides, else the prefixes."""
    for rule in rules:
        if rule.pattern.search(stem):
            return rule.apply(stem, index)
    found = _find_with_prefixes(stem, index)
    return None if found is None else [Target(found)]
