"""Which model parameter each adapter key changes.

An adapter names modules the way its trainer saw them: with a wrapper prefix
(``base_model.model.``, ``transformer.``, ``diffusion_model.``), or kohya-style with the
dots turned into underscores (``lora_unet_blocks_0_attn_to_q``), which is ambiguous on
its own (``to_q`` has an underscore too) and is therefore resolved against the model's
real module names. Rules from the config (regex -> replacement) are tried first.

Fused projections take rules too. A LoRA trained on a fused qkv (or Flux's ``linear1``)
onto a model with separate q/k/v weights: a rule whose replacement is a list of modules
splits the up matrix's rows over them in order, each placement a view of its rows with
the shared down matrix. Separate q/k/v LoRAs onto a model with one fused weight: rules
ending in ``[start:stop]`` place each on its rows, as one delta per slice whose up (and
diff) is set into zero rows of the fused weight's height. That was chosen over one
delta with a block-diagonal up and concatenated downs (what diffusers does when it fuses
projections) because each slice keeps its own scale exactly, as ``addmm``'s alpha: a
block-diagonal up would have to fold three scales into its values, rounding them in the
adapter's dtype, and the merge would no longer be the one each separate weight gets.
Adding a zero row is exact, so every row of the fused weight gets the same fp32 sum,
rounded once, as the separate weight it stands for; the padding costs rows x rank.

Resolution works on names and shapes only (``{parameter name: shape}``), so the same code
serves a loaded model and a checkpoint's headers (the planner's provider). That part
imports no torch and lives in :mod:`lora_cache.adapters.key_names`; this module adds the tensors
(placements on rows, deltas, shape checks).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace

import torch

from ..adapters import Adapter, AdapterFile, ModuleChange
from ..adapters.lycoris_parts import LOHA_ROLES, LOKR_ROLES, ROLES as FACTORED, kind_of, rank_of, shape_of
from ..terms.dora_lycoris import PEFT, ROWS, axis_of
from ..adapters.key_names import KeyResolutionError, KeyRule, ModuleIndex, Target, resolve_stem
from ..terms.lycoris_math import Factors
from ..terms.delta import Delta, lora_scale

__all__ = ["KeyResolutionError", "KeyRule", "ModuleIndex", "Placement", "Target", "plan_deltas", "resolve_adapter"]

_SHOWN = 20
_HOW_TO_FIX = (
    "Add a key rule that maps them to module names (config: lora.adapters[N].rules: "
    "[{match: '<regex on the key without its .lora_A/.lora_down/.alpha/.diff suffix>', "
    "replace: '<module name>'}]; Python: lora_cache.Adapter(path, rules=[(regex, replacement)])), "
    "or set strict: false to skip them with a warning."
)


@dataclass(frozen=True)
class Placement:
    """One module change (or a row slice of it) landing on one module (or rows of it)."""

    module: str
    change: ModuleChange
    source: slice | None = None  # rows of the change's up/diff this placement takes
    rows: slice | None = None  # rows of the module's weight it lands on


_NAMED_FIRST = (*LOHA_ROLES, *LOKR_ROLES, "down", "up", "mid", "diff", "magnitude", "dora_scale", "diff_b", "up_b")


def _named_key(change: ModuleChange) -> str:
    """The key a message names a module change by: a part that carries its weight (its down,
    a LoHa's ``hada_w1_a``, a LoKr's ``lokr_w1``, a diff) before its ``.alpha``, which says
    nothing of what the module is."""
    return next((change.keys[role] for role in _NAMED_FIRST if role in change.keys), next(iter(change.keys.values())))


def _named(change: ModuleChange) -> str:
    """:func:`_named_key`, with the LyCORIS kind where the change is one (``... (LoHa)``)."""
    kind = kind_of(change.parts)
    return _named_key(change) + (f" ({kind})" if kind else "")


def _change_rows(change: ModuleChange) -> int | None:
    if kind_of(change.parts):  # LoHa, LoKr, Tucker LoCon: the rows of the change they make
        return shape_of(change.parts)[0]
    part = change.parts.get("up", change.parts.get("diff", change.parts.get("diff_b")))
    return None if part is None or part.dim() == 0 else int(part.shape[0])


def _rows_of(adapter: AdapterFile, key: str, target: Target, index: ModuleIndex) -> slice | None:
    """The rows of its weight ``target`` names: outright, as a part, or None for them all."""
    if target.part is None:
        return target.rows
    part, count = target.part
    height = index.shapes.get(f"{target.module}.weight", (0,))[0]
    if not part < count or height % count:
        raise KeyResolutionError(
            f"{adapter.path}: {key!r} is placed on part [{part}/{count}] of {target.module!r}, whose weight has "
            f"{height} rows; a part [k/n] is one of n equal parts of the rows, k from 0 to n - 1"
        )
    size = height // count
    return slice(part * size, (part + 1) * size)


def _split(adapter: AdapterFile, change: ModuleChange, targets: list[Target], index: ModuleIndex) -> list[Placement]:
    """A change on a fused projection, split by rows over separate modules (or rows of
    them) in order."""
    key = _named_key(change)
    spans = [_rows_of(adapter, key, t, index) for t in targets]
    if len(targets) == 1:
        return [Placement(targets[0].module, change, rows=spans[0])]
    sizes = [index.shapes.get(f"{t.module}.weight", (0,))[0] if rows is None else rows.stop - rows.start
             for t, rows in zip(targets, spans)]
    if sum(sizes) != _change_rows(change):
        raise KeyResolutionError(
            f"{adapter.path}: {key!r} has {_change_rows(change)} rows, but the modules it is split over "
            f"({', '.join(t.module for t in targets)}) have {' + '.join(map(str, sizes))} = {sum(sizes)}; "
            "does the rule list the right modules?"
        )
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [Placement(t.module, change, slice(a, a + n), rows) for t, rows, a, n in zip(targets, spans, starts, sizes)]


def _overlap(a: slice | None, b: slice | None) -> bool:
    return a is None or b is None or (a.start < b.stop and b.start < a.stop)


def _check_overlaps(adapter: AdapterFile, placements: list[Placement]) -> None:
    """Two keys may share a fused weight only on disjoint rows."""
    seen: dict[str, list[Placement]] = {}
    for p in placements:
        for other in seen.get(p.module, []):
            if _overlap(p.rows, other.rows):
                raise KeyResolutionError(
                    f"{adapter.path}: keys {other.change.stem!r} and {p.change.stem!r} both name module "
                    f"{p.module!r}; remove one or add a key rule that tells them apart"
                )
        seen.setdefault(p.module, []).append(p)


def _unmatched_message(path: str, keys: list[str], index: ModuleIndex) -> str:
    shown = "\n".join(f"  {k}" for k in keys[:_SHOWN])
    more = f"\n  ... and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
    return (
        f"{path}: {len(keys)} adapter key(s) match no module of the model:\n{shown}{more}\n"
        f"The model's modules look like: {', '.join(index.examples())}.\n{_HOW_TO_FIX}"
    )


def resolve_adapter(adapter: AdapterFile, spec: Adapter, index: ModuleIndex) -> list[Placement]:
    """Where each module change of ``adapter`` lands in the model.

    Unmatched keys raise :class:`KeyResolutionError` (first 20 and a count), or warn and are
    skipped when ``spec.strict`` is false. Two keys that land on one module (on rows that
    overlap) are an error.
    """
    rules = [KeyRule.parse(r) for r in (*spec.rules, *adapter.rules)]  # the user's first, then the reader's
    placements: list[Placement] = []
    unmatched: list[str] = []
    for stem, change in adapter.modules.items():
        try:
            targets = resolve_stem(stem, rules, index)
        except KeyResolutionError as exc:
            raise KeyResolutionError(f"{adapter.path}: adapter key {_named_key(change)!r} {exc}") from None
        if targets is None and set(change.parts) == {"diff"}:  # a full diff of a bare parameter
            found = index.find_parameter(stem)
            targets = None if found is None else [Target(found)]
        if targets is None:
            unmatched.append(_named(change))
        else:
            placements.extend(_split(adapter, change, targets, index))
    _check_overlaps(adapter, placements)
    if unmatched:
        message = _unmatched_message(adapter.path, unmatched, index)
        if spec.strict:
            raise KeyResolutionError(message)
        warnings.warn(message.replace(_HOW_TO_FIX, "strict: false, so they are skipped."), stacklevel=3)
    return placements


def _check_shape(adapter: AdapterFile, key: str, param: str, delta: Delta, index: ModuleIndex) -> None:
    expected = index.shapes.get(param)
    if expected is None:
        raise KeyResolutionError(f"{adapter.path}: {key!r} changes {param!r}, which the model does not have")
    if tuple(delta.shape) != tuple(expected):
        raise KeyResolutionError(
            f"{adapter.path}: {key!r} gives a change of shape {tuple(delta.shape)} but the model's "
            f"{param!r} has shape {tuple(expected)}{index.notes.get(param, '')}; is the adapter made for another "
            "model (or size)?"
        )


def _placed(adapter: AdapterFile, key: str, tensor: torch.Tensor, place: Placement, param: str,
            index: ModuleIndex) -> torch.Tensor:
    """``tensor``'s rows as ``place`` puts them: a row slice (a view) of a fused change, or
    the change set into zero rows of a fused weight (see :func:`plan_deltas`)."""
    if place.source is not None:
        tensor = tensor[place.source]
    if place.rows is None:
        return tensor
    total = index.shapes.get(param, (None,))[0]
    if total is None or place.rows.stop > total or tensor.shape[0] != place.rows.stop - place.rows.start:
        raise KeyResolutionError(
            f"{adapter.path}: {key!r} has {tensor.shape[0]} rows but is placed on rows "
            f"{place.rows.start}:{place.rows.stop} of {param!r} ({total} rows); fix the rule's [start:stop]"
        )
    padded = tensor.new_zeros((total, *tensor.shape[1:]))
    padded[place.rows] = tensor
    return padded


def _magnitude(adapter: AdapterFile, change: ModuleChange, place: Placement, param: str):
    """``(magnitude, whose DoRA)`` of a change: peft's ``lora_magnitude_vector`` or LyCORIS's
    ``dora_scale`` (:mod:`lora_cache.terms.dora_lycoris`), None for plain LoRA; refused on part of
    a fused weight, whose other rows it would rescale to nothing."""
    if "dora_scale" in change.parts:
        return _dora_scale(adapter, change, place, param)
    magnitude = change.parts.get("magnitude")
    if magnitude is None and adapter.config is not None and adapter.config.use_dora:
        raise KeyResolutionError(
            f"{adapter.path}: {change.keys['up']!r} has no lora_magnitude_vector beside it, but its "
            "adapter_config.json says use_dora: merged as plain LoRA it would be wrong (truncated adapter?)"
        )
    if magnitude is not None and (place.rows is not None or place.source is not None):
        raise KeyResolutionError(
            f"{adapter.path}: {change.keys['magnitude']!r} is a DoRA magnitude vector placed on some rows of "
            f"{param!r}; DoRA rescales whole rows of the weight it was trained on, so it merges only onto that "
            "weight whole (drop the [start:stop] rule, or merge into a model with the separate projection)"
        )
    if magnitude is not None and magnitude.dim() == 2 and magnitude.shape[0] == 1 < change.parts["up"].shape[0]:
        raise KeyResolutionError(
            f"{adapter.path}: {change.keys['magnitude']!r} has shape {tuple(magnitude.shape)}: magnitudes of input "
            "columns (LyCORIS's dora_scale on the input axis, as a converter may hand it on), where peft's DoRA norms "
            "rows; merging it so would be wrong. A LyCORIS file merges with convert='native', as ComfyUI merges it"
        )
    return (None if magnitude is None else magnitude.flatten()), PEFT


def _dora_scale(adapter: AdapterFile, change: ModuleChange, place: Placement, param: str):
    """LyCORIS's ``dora_scale``: the axis its shape names. On the row axis each row is
    normed alone, so the rows of a fused weight (Flux's ``qkv``, ``linear1``) split over the
    model's own weights take their rows of it, as ComfyUI's merge of the fused weight gives
    them; the column axis norms the whole fused weight's columns, so it merges only onto
    that weight whole, as does a scale placed on part of a weight's rows."""
    key, scale = change.keys["dora_scale"], change.parts["dora_scale"]
    factored = kind_of(change.parts) is not None
    if ("up" not in change.parts and not factored) or "magnitude" in change.parts:
        raise KeyResolutionError(f"{adapter.path}: {key!r} needs a LoRA pair beside it and no lora_magnitude_vector "
                                 "(truncated or mixed adapter?)")
    axis = axis_of(scale, shape_of(change.parts)[0] if factored else change.parts["up"].shape[0])
    if place.rows is not None or (place.source is not None and axis != ROWS):
        raise KeyResolutionError(f"{adapter.path}: {key!r} is a DoRA scale placed on some rows of {param!r}; DoRA "
                                 "norms the weight it was trained on, so it merges only onto that weight whole")
    return (scale.flatten() if place.source is None else scale.flatten()[place.source]), axis


def _factors(adapter: AdapterFile, change: ModuleChange, key: str, place: Placement, param: str,
             index: ModuleIndex) -> Factors:
    """A LoHa's, LoKr's or Tucker LoCon's parts as one factored change on ``param``
    (:mod:`lora_cache.terms.lycoris_math`): the rows ``place`` takes, landing on the rows it names."""
    rows, width = shape_of(change.parts)
    taken = (0, rows) if place.source is None else (place.source.start, place.source.stop)
    expected = index.shapes.get(param)
    span = None if place.rows is None else (place.rows.start, place.rows.stop)
    height = taken[1] - taken[0] if span is None else (expected or (0,))[0]
    if span is not None and (span[1] > height or span[1] - span[0] != taken[1] - taken[0]):
        raise KeyResolutionError(
            f"{adapter.path}: {key!r} has {taken[1] - taken[0]} rows but is placed on rows {span[0]}:{span[1]} of "
            f"{param!r} ({height} rows); fix the rule's [start:stop]")
    fits = expected is not None and expected[0] == height and math.prod(expected[1:]) == width
    shape = tuple(expected) if fits else (height, width)  # a misfit: the shape check names both
    parts = tuple((role, tensor) for role, tensor in sorted(change.parts.items())
                  if role in FACTORED or role in ("up", "down"))
    return Factors(kind_of(change.parts), parts, shape, taken[0], span)


def _module_deltas(adapter: AdapterFile, spec: Adapter, place: Placement, index: ModuleIndex):
    """Yield ``(parameter, key, Delta)`` for the weight and bias changes of one placement."""
    change, module, strength = place.change, place.module, spec.strength
    parts = change.parts
    factored = kind_of(parts)  # LoHa, LoKr, Tucker LoCon (lora_cache.terms.lycoris_math), else None
    scale = 0.0
    if "up" in parts or factored:
        alpha = adapter.alpha(change, spec.alpha)  # the override, unless a converter folded it in already
        rslora = adapter.rslora_for(change) if spec.rslora is None else spec.rslora
        outside = "dora_scale" in parts  # LyCORIS's DoRA takes its strength outside the norm (dora_lycoris)
        rank = rank_of(parts) if factored else adapter.rank(change)  # None: a LoKr of whole halves, no alpha
        scale = (1.0 if outside else strength) if rank is None else \
            lora_scale(1.0 if outside else strength, alpha, rank, rslora)
    if factored:
        key, param = next(change.keys[r] for r in (*LOHA_ROLES, *LOKR_ROLES, "up") if r in parts), f"{module}.weight"
        magnitude, dora = _magnitude(adapter, change, place, param)
        yield param, key, Delta(f"{adapter.path}: {key!r}", scale=scale, magnitude=magnitude, dora=dora,
                                dora_strength=strength if dora != PEFT else 1.0,
                                factors=_factors(adapter, change, key, place, param, index))
    elif "up" in parts or "diff" in parts:
        key = change.keys.get("up", change.keys.get("diff"))
        param = module if module in index.shapes else f"{module}.weight"  # a bare parameter: Wan's scale_shift_table
        up = None if "up" not in parts else _placed(adapter, key, parts["up"], place, param, index)
        diff = None if "diff" not in parts else _placed(adapter, key, parts["diff"], place, param, index)
        magnitude, dora = _magnitude(adapter, change, place, param)
        yield param, key, Delta(f"{adapter.path}: {key!r}", up, parts.get("down"), scale, diff, strength,
                                magnitude=magnitude, dora=dora, dora_strength=strength if dora != PEFT else 1.0)
    for role, factor in (("diff_b", strength), ("up_b", scale)):  # up_b: peft's lora_bias, scaled as B @ A
        if role in parts:
            key, param = change.keys[role], f"{module}.bias"
            bias = _placed(adapter, key, parts[role], place, param, index)
            yield param, key, Delta(f"{adapter.path}: {key!r}", diff=bias, diff_scale=factor)


def plan_deltas(adapters: list[tuple[AdapterFile, Adapter]], index: ModuleIndex) -> dict[str, list[Delta]]:
    """Every changed parameter with its deltas in adapter order, in the model's parameter order."""
    planned: dict[str, list[Delta]] = {}
    for adapter, spec in adapters:
        for place in resolve_adapter(adapter, spec, index):
            for param, key, delta in _module_deltas(adapter, spec, place, index):
                delta.check()
                _check_shape(adapter, key, param, delta, index)
                planned.setdefault(param, []).append(replace(delta, values_check=adapter.values_check))
    return {name: planned[name] for name in index.shapes if name in planned}
