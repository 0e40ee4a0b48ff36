"""Full weight differences (ComfyUI's ``.diff`` / ``.diff_b``) of a file diffusers converts.

A ComfyUI or lightx2v file may carry, beside its LoRA factors, whole-weight changes:
``blocks.1.self_attn.o.diff`` (a weight), ``norm3.diff`` and ``norm3.diff_b`` (a norm's
weight and bias). ComfyUI merges them as ``W += strength * diff``; diffusers' LoRA
converters drop them (Wan's logs it at DEBUG), which would merge a different model
without a word. So they are taken out of the file before diffusers' LoRA converter runs,
and named in the model's terms by diffusers' own single-file converter for the model's
class (``SINGLE_FILE_LOADABLE_CLASSES``: the function that turns an original checkpoint
into the model's names): a diff changes a weight the way the checkpoint's weight of the
same name is changed, so the diff goes through the same renaming (and the same splits
and permutations, which are linear). A diff that converter cannot name is refused with
its key; it is never dropped.

Flux is the exception: its single-file converter needs the whole checkpoint (it counts
the blocks and pops every key of each), so a partial one fails there. A Flux file's diffs
(ComfyUI's BFL names: ``diffusion_model.double_blocks.0.img_attn.qkv.diff``) are placed
by the one table of BFL names that kohya's Flux files are read with
(:data:`lora_cache.adapters.formats.kohya_flux.BFL_RULES`, and its kohya spelling
``lora_unet_double_blocks_0_img_attn_qkv``, which ComfyUI also maps): a diff on a fused weight
(``img_attn.qkv``, ``linear1``) splits by rows onto the model's weights in order, each as
tall as its weight, as ComfyUI's ``W += strength * diff`` on the fused weight means; the
final modulation's halves are swapped as the checkpoint's are. A diff no rule names is
refused with its key.

An SD/SDXL UNet is the other: its single-file converter fails on a part of an SDXL
checkpoint (it reads ``label_emb`` first) and takes no diffusers name, where LyCORIS's full
algorithm through kohya writes the UNet's own (``lora_unet_down_blocks_0_resnets_0_conv1.diff``).
Its diffs are placed by its original (SGM) names' rules (:mod:`lora_cache.adapters.sgm_names`)
and by its own names, which the original ones never share.
"""

from __future__ import annotations

import inspect

from .key_names import KeyRule, ModuleIndex
from .formats.kohya_flux import BFL_RULES, RULES
from .spec import AdapterError

__all__ = ["diff_placer", "full_diff_stems", "place_full_diffs", "without_full_diffs"]

# Model classes whose full diffs are placed by rules of this package (name, rules), not by
# diffusers' single-file converter; the name goes into the cache key.
_RULED = {"FluxTransformer2DModel": ("lora_cache Flux BFL rules v1", BFL_RULES + RULES)}  # ComfyUI's or kohya's names
# A UNet's own (diffusers') names, kohya's and dotted spellings: the original (SGM) names share
# none of its block names, so a stem in these can mean nothing else.
_UNET_OWN_NAMES = ((r"^(?:lora_unet_|lycoris_)(.+)$", r"lora_unet_\1"),
                   (r"^(?:(?:model\.)?diffusion_model\.|unet\.)?(.+)$", r"\1"))

_PREFIXES = ("model.diffusion_model.", "diffusion_model.")


def _rules_for(model) -> tuple[str, tuple] | None:
    """``(name, rules)`` where this package's rules place ``model``'s full diffs, else None
    (diffusers' single-file converter does). An SD/SDXL UNet's: its original names
    (:mod:`lora_cache.adapters.sgm_names`) and its own; the single-file converter needs a
    whole SDXL checkpoint (it reads ``label_emb`` first) and takes no diffusers name."""
    if model is None:
        return None
    if type(model).__name__ in _RULED:
        return _RULED[type(model).__name__]
    from .sgm_names import model_rules

    rules = model_rules(model)
    return ("lora_cache SGM UNet rules v1", rules + _UNET_OWN_NAMES) if rules else None


def _ruled(model) -> bool:
    return _rules_for(model) is not None


def _full_bias(change, ruled: bool) -> bool:
    """Whether a change's ``.diff_b`` is a full diff of the bias: always without LoRA factors;
    beside them diffusers' converter reads it as peft's ``lora_B.bias`` (Wan's does), except
    where this package places the diffs (Flux's converter drops it without a word, and
    ComfyUI merges it as the bias's diff)."""
    return "diff_b" in change.parts and ("up" not in change.parts or ruled)


def full_diff_stems(modules: dict, model=None) -> list[str]:
    """The stems with a full diff for ``model``: ``.diff``, or a ``.diff_b`` :func:`_full_bias` takes."""
    ruled = _ruled(model)
    return sorted(stem for stem, change in modules.items() if "diff" in change.parts or _full_bias(change, ruled))


def without_full_diffs(tensors: dict, modules: dict, stems: list[str], model=None) -> dict:
    """``tensors`` without the full diffs of ``stems`` (and the alphas of those without LoRA
    factors, which scale nothing; beside factors the alpha is theirs, for the converter)."""
    ruled, taken = _ruled(model), set()
    for change in (modules[s] for s in stems):
        roles = ["diff"] + ["diff_b"] * _full_bias(change, ruled) + ["alpha"] * ("up" not in change.parts)
        taken.update(change.keys[role] for role in roles if role in change.keys)
    return {key: value for key, value in tensors.items() if key not in taken}


def _mapping_fn(model):
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    entry = SINGLE_FILE_LOADABLE_CLASSES.get(type(model).__name__)
    return None if entry is None else entry["checkpoint_mapping_fn"]


def _renamed(fn, model, checkpoint: dict) -> dict:
    """The model's names for a partial checkpoint, by diffusers' single-file converter."""
    kwargs = {"config": dict(model.config)} if "config" in inspect.signature(fn).parameters else {}
    return fn(checkpoint=dict(checkpoint), **kwargs)


def diff_placer(model) -> str:
    """What names a file's full diffs on ``model``: a rule table of this package, or
    diffusers' single-file converter (said in the cache key: it decides the merged bytes)."""
    ruled = _rules_for(model)
    return "the single-file converter" if ruled is None else ruled[0]


def _diff_parts(change, ruled: bool) -> dict:
    """``{"weight": diff, "bias": diff_b}`` of a change (a ``.diff_b`` :func:`_full_bias` does
    not take is left to the LoRA converter)."""
    parts = {"weight": change.parts.get("diff"), "bias": change.parts["diff_b"] if _full_bias(change, ruled) else None}
    return {kind: diff for kind, diff in parts.items() if diff is not None}


def _spans(targets, heights: list[int]) -> list[slice | None]:
    """The rows of its weight each target covers (None: all of them)."""
    spans = []
    for target, height in zip(targets, heights):
        if target.part is not None:
            index, count = target.part
            spans.append(slice(index * height // count, (index + 1) * height // count))
        else:
            spans.append(target.rows)
    return spans


def _by_rules(stem: str, change, rules, shapes: dict, placed: dict, owner: dict, component: str) -> str:
    """Place one stem's diffs by ``rules`` into ``placed`` (row slices of a fused diff, set
    into zero rows where a target is part of a weight; ``owner``: the stem each placed key
    came from); the reason it cannot, else ''."""
    rule = next((r for r in rules if r.pattern.search(stem)), None)
    if rule is None:
        return "lora_cache's rules for this model name no such module"
    targets = rule.apply(stem, ModuleIndex(shapes))
    if targets is None:
        names = (rule.replace,) if isinstance(rule.replace, str) else rule.replace
        return f"it names {', '.join(rule.pattern.sub(n, stem) for n in names)}, which the model lacks in part"
    heights = [shapes[f"{t.module}.weight"][0] for t in targets]
    spans = _spans(targets, heights)
    sizes = [h if s is None else s.stop - s.start for h, s in zip(heights, spans)]
    for kind, diff in _diff_parts(change, True).items():
        if diff.shape[0] != sum(sizes):
            return f"its {kind} diff has {diff.shape[0]} rows where {', '.join(t.module for t in targets)} " \
                   f"have {' + '.join(map(str, sizes))}"
        start = 0
        for target, span, size in zip(targets, spans, sizes):
            param = f"{target.module}.{kind}"
            if param not in shapes:
                return f"the model has no {param}"
            if tuple(shapes[param][1:]) != tuple(diff.shape[1:]):
                return f"its {kind} diff of shape {tuple(diff.shape)} does not fit {param} of shape {shapes[param]}"
            key = f"{component}.{target.module}.{'diff' if kind == 'weight' else 'diff_b'}"
            piece = diff[start:start + size]
            start += size
            if owner.setdefault(key, stem) != stem:
                return f"the key of {owner[key]!r} changes {param} too"
            if span is None:
                placed[key] = piece
            else:
                placed.setdefault(key, diff.new_zeros((shapes[param][0], *diff.shape[1:])))[span] = piece
    return ""


def _place_by_rules(path: str, modules: dict, stems: list[str], model, component: str, rules) -> tuple[dict, list]:
    """``(placed diffs, [(key, why) refused])`` of a model whose diffs rules place."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    parsed = [KeyRule.parse(rule) for rule in rules]
    placed, owner, refused = {}, {}, []
    for stem in stems:
        change = modules[stem]
        why = _by_rules(stem, change, parsed, shapes, placed, owner, component)
        if why:
            refused.append((change.keys.get("diff", change.keys.get("diff_b")), why))
    return placed, refused


def place_full_diffs(path: str, modules: dict, stems: list[str], model, component: str) -> dict:
    """The full diffs of ``stems`` under the model's names: ``<component>.<module>.diff`` and
    ``.diff_b``. Refuses, naming the keys, what the model's converter (or rules) cannot name."""
    if not stems:
        return {}
    ruled = _rules_for(model)
    if ruled is not None:
        placed, refused = _place_by_rules(path, modules, stems, model, component, ruled[1])
        _refuse(path, refused)
        return placed
    fn = None if model is None else _mapping_fn(model)
    placed, refused = {}, []
    for stem in stems:
        change = modules[stem]
        name = next((stem[len(p):] for p in _PREFIXES if stem.startswith(p)), stem)
        checkpoint = {f"{name}.{kind}": diff for kind, diff in _diff_parts(change, False).items()}
        try:
            renamed = _renamed(fn, model, checkpoint) if fn is not None else {}
        except Exception as exc:  # noqa: BLE001 - diffusers' converters fail by KeyError on partial checkpoints
            renamed, reason = {}, f"{type(exc).__name__}: {exc}"
        else:
            reason = "" if fn is not None else f"diffusers has no single-file converter for {type(model).__name__}"
        suffixes = {key.rpartition(".")[2] for key in renamed}
        if not renamed or not suffixes <= {"weight", "bias"} or len(renamed) < len(checkpoint):
            refused.append((change.keys.get("diff", change.keys.get("diff_b")), reason or f"it gives {sorted(renamed)}"))
            continue
        for key, value in renamed.items():
            module, _, kind = key.rpartition(".")
            placed[f"{component}.{module}.{'diff' if kind == 'weight' else 'diff_b'}"] = value
    _refuse(path, refused)
    return placed


def _refuse(path: str, refused: list) -> None:
    """Refuse the diffs that cannot be placed, naming their keys and why."""
    if refused:
        shown = "; ".join(f"{key!r} ({why})" for key, why in refused[:5])
        raise AdapterError(
            f"{path}: {len(refused)} full weight difference(s) cannot be placed on the model: {shown}"
            f"{' ...' if len(refused) > 5 else ''}. diffusers' LoRA loader drops them; merging without them would be "
            "another model. Pass convert='native' with key rules that name their modules, or remove them"
        )
