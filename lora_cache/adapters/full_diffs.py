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
"""

from __future__ import annotations

import inspect

from .spec import AdapterError

__all__ = ["full_diff_stems", "place_full_diffs", "without_full_diffs"]

_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
_AS_CHECKPOINT = {"diff": "weight", "diff_b": "bias"}


def full_diff_stems(modules: dict) -> list[str]:
    """The stems whose change is a full diff: ``.diff``, or a ``.diff_b`` without LoRA factors
    (a ``.diff_b`` beside factors is peft's ``lora_B.bias`` to diffusers' converter)."""
    return sorted(stem for stem, change in modules.items()
                  if "diff" in change.parts or ("diff_b" in change.parts and "up" not in change.parts))


def without_full_diffs(tensors: dict, modules: dict, stems: list[str]) -> dict:
    """``tensors`` without the full diffs of ``stems`` (and their alphas, which scale nothing)."""
    taken = {modules[s].keys[role] for s in stems for role in ("diff", "diff_b", "alpha") if role in modules[s].keys
             and (role != "diff_b" or "up" not in modules[s].parts)}
    return {key: value for key, value in tensors.items() if key not in taken}


def _mapping_fn(model):
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    entry = SINGLE_FILE_LOADABLE_CLASSES.get(type(model).__name__)
    return None if entry is None else entry["checkpoint_mapping_fn"]


def _renamed(fn, model, checkpoint: dict) -> dict:
    """The model's names for a partial checkpoint, by diffusers' single-file converter."""
    kwargs = {"config": dict(model.config)} if "config" in inspect.signature(fn).parameters else {}
    return fn(checkpoint=dict(checkpoint), **kwargs)


def place_full_diffs(path: str, modules: dict, stems: list[str], model, component: str) -> dict:
    """The full diffs of ``stems`` under the model's names: ``<component>.<module>.diff`` and
    ``.diff_b``. Refuses, naming the keys, what the model's converter cannot name."""
    if not stems:
        return {}
    fn = None if model is None else _mapping_fn(model)
    placed, refused = {}, []
    for stem in stems:
        change = modules[stem]
        name = next((stem[len(p):] for p in _PREFIXES if stem.startswith(p)), stem)
        checkpoint = {f"{name}.{_AS_CHECKPOINT[role]}": change.parts[role] for role in ("diff", "diff_b")
                      if role in change.parts and (role == "diff" or "up" not in change.parts)}
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
    if refused:
        shown = "; ".join(f"{key!r} ({why})" for key, why in refused[:5])
        raise AdapterError(
            f"{path}: {len(refused)} full weight difference(s) cannot be placed on the model: {shown}"
            f"{' ...' if len(refused) > 5 else ''}. diffusers' LoRA loader drops them; merging without them would be "
            "another model. Pass convert='native' with key rules that name their modules, or remove them"
        )
    return placed
