r"""Where a module's alpha (and rank) is stored, and which place wins.

A LoRA's scale is alpha / r; missing the place an alpha is stored in gives a wrong image
without any error, so every place is read:

1. an explicit override (``Adapter(alpha=...)``, config ``alpha:``) wins over everything;
2. the module's own ``.alpha`` tensor (kohya, ComfyUI, diffusers' network alphas);
3. peft's ``adapter_config.json`` beside the file: ``alpha_pattern`` for the module,
   else ``lora_alpha``;
4. diffusers' adapter metadata in the file's header (``lora_adapter_metadata``, written
   by ``save_lora_weights(..., transformer_lora_adapter_metadata=...)`` per component,
   or by ``save_lora_adapter``): ``alpha_pattern`` for the module, else ``lora_alpha``;
5. a plain header entry ``alpha``, ``lora_alpha`` or ``network_alpha`` (ai-toolkit and
   lightx2v write ``{"alpha": "4"}``; diffusers' MiniMax-H3 loader reads it): one alpha
   for every module;
6. none: alpha = r (scale 1, the peft, diffusers, kohya and ComfyUI convention).

kohya's ``ss_network_alpha`` header entry is never an alpha: it records the training
command (``--network_alpha``, or ``Dynamic`` after ``resize_lora.py --dynamic_method``),
and every reference loader of kohya's files ignores it. kohya's own
``create_network_from_weights`` takes a module without ``.alpha`` at alpha = its rank, as
diffusers' converters (``default_alpha = rank``) and ComfyUI (scale 1 without an alpha) do;
reading it would merge a file without ``.alpha`` keys at ``ss_network_alpha / rank``,
a wrong weight without any error.

Sources 2-5 each state the alpha the trainer used. Where two of them give a module
different alphas the file contradicts itself, and which one was meant cannot be told:
that is an :class:`AdapterError` naming both (an override settles it); the header's
entries must agree among themselves.

peft's ``rank_pattern`` and ``alpha_pattern`` are matched as peft matches them
(``peft.utils.other.get_pattern_key``): ``re.match(r"(.*\.)?(PATTERN)$", name)``, first
pattern in the config's order, against the module's name in the base model, that is
without peft's ``base_model.model.`` wrapper, so an anchored ``^blocks\.1\.`` pattern
holds. An ``adapter_config.json`` describes the file peft wrote beside it
(``adapter_model.safetensors`` or ``.bin``), never another file in the same folder.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from .spec import AdapterError

__all__ = ["PeftConfig", "AlphaSources", "diffusers_metadata", "header_alpha", "peft_config_from", "peft_name"]

_AGREE = 1e-3  # an alpha stored in fp16 (0.1 -> 0.09998) agrees with the same alpha in JSON


@dataclass(frozen=True)
class PeftConfig:
    """The fields of a peft ``LoraConfig`` that decide a module's scale."""

    r: int | None = None
    lora_alpha: float | None = None
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)
    use_rslora: bool = False
    use_dora: bool = False  # every LoRA pair then has a magnitude vector (lora_cache.targets.keys checks)

    @staticmethod
    def _lookup(patterns: dict, stem: str):
        """The first pattern peft's ``get_pattern_key`` would pick for the module ``stem``
        names (its name in the base model: peft's wrapper prefix removed)."""
        name = peft_name(stem)
        for pattern, value in patterns.items():
            if re.match(rf"(.*\.)?({pattern})$", name):
                return pattern, value
        return None

    def rank_for(self, stem: str) -> int | None:
        found = self._lookup(self.rank_pattern, stem)
        return self.r if found is None else int(found[1])

    def alpha_for(self, stem: str) -> tuple[str, float] | None:
        """``(which field, alpha)`` for a module, or None when the config has no alpha."""
        found = self._lookup(self.alpha_pattern, stem)
        if found is not None:
            return f"alpha_pattern[{found[0]!r}]", float(found[1])
        return None if self.lora_alpha is None else ("lora_alpha", float(self.lora_alpha))


_PEFT_WRAPPER = "base_model.model."
_HEADER_ALPHAS = ("alpha", "lora_alpha", "network_alpha")  # plain header entries that state one alpha for all


def peft_name(stem: str) -> str:
    """The module's name as peft matches its patterns: without ``base_model.model.``."""
    return stem.removeprefix(_PEFT_WRAPPER)


def _number(where: str, name: str, value, whole: bool = False):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AdapterError(f"{where}: {name} is {value!r}; expected a finite number")
    if whole and (value != int(value) or value <= 0):
        raise AdapterError(f"{where}: {name} is {value!r}; expected a positive whole number")
    return int(value) if whole else float(value)


def _patterns(where: str, name: str, raw, whole: bool) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise AdapterError(f"{where}: {name} is {type(raw).__name__}; expected a mapping of module pattern -> value")
    return {str(k): _number(where, f"{name}[{k!r}]", v, whole) for k, v in raw.items()}


def peft_config_from(where: str, raw: dict) -> PeftConfig:
    """Read the scale fields of a peft config (``adapter_config.json`` or diffusers metadata)."""
    if not isinstance(raw, dict):
        raise AdapterError(f"{where}: expected a JSON object, found {type(raw).__name__}")
    if raw.get("fan_in_fan_out"):  # peft transposes B @ A onto such weights; a square one would take it as is
        raise AdapterError(f"{where}: fan_in_fan_out is set: the adapter targets weights stored as (in, out) "
                           "(transformers' Conv1D, GPT-2's), which lora_cache does not merge; merge it with "
                           "peft's merge_and_unload")
    return PeftConfig(
        r=_number(where, "r", raw.get("r"), whole=True),
        lora_alpha=_number(where, "lora_alpha", raw.get("lora_alpha")),
        rank_pattern=_patterns(where, "rank_pattern", raw.get("rank_pattern"), whole=True),
        alpha_pattern=_patterns(where, "alpha_pattern", raw.get("alpha_pattern"), whole=False),
        use_rslora=bool(raw.get("use_rslora", False)),
        use_dora=bool(raw.get("use_dora", False)),
    )


def diffusers_metadata(path: str, header_metadata: dict) -> dict[str, PeftConfig]:
    """diffusers' adapter metadata by component prefix (``""`` when unprefixed).

    ``save_lora_weights`` stores ``{"transformer.r": 8, "transformer.lora_alpha": 16, ...}``
    (one group per component); ``save_lora_adapter`` stores the config unprefixed.
    """
    raw = header_metadata.get("lora_adapter_metadata")
    if raw is None:
        return {}
    where = f"{path}: header metadata 'lora_adapter_metadata'"
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise AdapterError(f"{where} is not JSON ({exc})") from None
    if not isinstance(parsed, dict):
        raise AdapterError(f"{where}: expected a JSON object, found {type(parsed).__name__}")
    groups: dict[str, dict] = {}
    for key, value in parsed.items():
        prefix, _, name = key.rpartition(".") if "." in key and not key.startswith(".") else ("", "", key)
        groups.setdefault(prefix, {})[name] = value
    return {p: peft_config_from(f"{where} ({p or 'unprefixed'})", fields) for p, fields in groups.items()}


def _header_number(path: str, header_metadata: dict, name: str) -> float | None:
    """A header entry read as a number (the header holds strings), or None when absent."""
    raw = header_metadata.get(name)
    if raw in (None, "", "None"):
        return None
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise AdapterError(f"{path}: header metadata {name}={raw!r} is not a number") from None
    if not math.isfinite(value):
        raise AdapterError(f"{path}: header metadata {name}={raw!r} is not finite")
    return value


def _header_entries(path: str, header_metadata: dict) -> list[tuple[str, float]]:
    """Every alpha the header states, ``(entry, value)``; entries that disagree are an error."""
    found = [(n, v) for n in _HEADER_ALPHAS
             if (v := _header_number(path, header_metadata, n)) is not None]
    for (first, a), (other, b) in zip(found, found[1:]):
        if not math.isclose(a, b, rel_tol=_AGREE):
            raise AdapterError(
                f"{path}: header metadata {first}={a:g} but {other}={b:g}; the file contradicts itself: fix one, "
                "or give the alpha explicitly (Adapter(alpha=...))"
            )
    return found


def header_alpha(path: str, header_metadata: dict) -> tuple[str, float] | None:
    """The plain header entry (``alpha``, ``lora_alpha``, ``network_alpha``) stating one
    alpha for every module, as ``(entry, value)``, or None."""
    found = _header_entries(path, header_metadata)
    return found[0] if found else None


# the components diffusers' save_lora_weights prefixes keys and metadata with: a stem under one
# of them is never another one's, although the header holds that one's metadata alone
_COMPONENTS = frozenset({"transformer", "transformer_2", "unet", "prior", "decoder", "text_encoder",
                         "text_encoder_2", "text_encoder_3"})


@dataclass
class AlphaSources:
    """Every place of one file that may state alphas and ranks (see the module docstring)."""

    path: str
    peft: PeftConfig | None = None  # adapter_config.json beside the file
    metadata: dict[str, PeftConfig] = field(default_factory=dict)  # diffusers', by component
    header: tuple[str, float] | None = None  # a plain header entry: (name, alpha), see header_alpha

    def _metadata_for(self, stem: str) -> tuple[str, str, PeftConfig] | None:
        """The metadata group for a stem, and the stem as that group names it."""
        for prefix, config in self.metadata.items():
            if prefix and stem.startswith(prefix + "."):
                return prefix, stem[len(prefix) + 1 :], config
        if "" in self.metadata:
            return "", stem, self.metadata[""]
        if len(self.metadata) == 1 and stem.split(".", 1)[0] not in _COMPONENTS:
            prefix, config = next(iter(self.metadata.items()))  # one component's, stems written without its prefix
            return prefix, stem, config
        return None  # another component's stem: diffusers' save_lora_weights writes metadata per component

    def configs_for(self, stem: str) -> list[tuple[str, str, PeftConfig]]:
        """``(source name, stem as the config names it, config)`` in precedence order."""
        found = []
        if self.peft is not None:
            found.append(("adapter_config.json", stem, self.peft))
        meta = self._metadata_for(stem)
        if meta is not None:
            prefix, inner, config = meta
            found.append((f"lora_adapter_metadata{f' {prefix!r}' if prefix else ''}", inner, config))
        return found

    def alpha(self, stem: str, stored: tuple[str, float] | None) -> float | None:
        """The module's alpha; ``stored`` is its ``.alpha`` tensor as ``(key, value)``."""
        return self.resolve(stem, stored)[0]

    def resolve(self, stem: str, stored: tuple[str, float] | None) -> tuple[float | None, str]:
        """``(the module's alpha, where it was read from)``: the canonical form's record of
        a scale's origin (None, ``"none: alpha = rank"`` when no place states one)."""
        stated = [] if stored is None else [(f"{stored[0]!r}", stored[1])]
        for name, inner, config in self.configs_for(stem):
            found = config.alpha_for(inner)
            if found is not None:
                stated.append((f"{name} {found[0]}", found[1]))
        if self.header is not None:
            stated.append((f"header metadata {self.header[0]!r}", self.header[1]))
        for (first, a), (other, b) in zip(stated, stated[1:]):
            if not math.isclose(a, b, rel_tol=_AGREE):
                raise AdapterError(
                    f"{self.path}: module {stem!r} has alpha {a:g} from {first} but {b:g} from {other}; "
                    "the file contradicts itself: fix one, or give the alpha explicitly (Adapter(alpha=...))"
                )
        if stated:
            return stated[0][1], stated[0][0]
        return None, "none: alpha = rank"

    def check_rank(self, stem: str, key: str, rank: int) -> None:
        """A rank that contradicts a config's ``r``/``rank_pattern`` is a broken pairing."""
        for name, inner, config in self.configs_for(stem):
            expected = config.rank_for(inner)
            if expected is not None and expected != rank:
                raise AdapterError(
                    f"{self.path}: {key!r} has rank {rank} but {name} says r={expected} for it; "
                    "fix r/rank_pattern or use the matching config"
                )

    def rslora(self, stem: str) -> bool:
        return any(config.use_rslora for _, _, config in self.configs_for(stem))
