"""diffusers' older key spellings turned into peft's, as diffusers' own loaders turn them.

``lora_state_dict`` hands some layouts back in diffusers' older spellings: a kohya
sd-scripts file for SD 1.x, 2.x or SDXL comes back as ``unet.….processor.to_q_lora.down.weight``
and ``unet.….lora.down.weight``, its text encoders as ``text_encoder.….to_q_lora.down.weight``
and ``….lora_linear_layer.down.weight``, with its alphas keyed by the down matrix
(``<down key>.alpha``) or by the module (``<module>.alpha``). diffusers' loaders rename
them to peft's (``lora_A``/``lora_B``) before peft reads them: ``load_lora_adapter``
with ``convert_unet_state_dict_to_peft`` for the denoiser, ``load_lora_into_text_encoder``
with ``convert_state_dict_to_diffusers`` and then ``convert_state_dict_to_peft`` for a
text encoder. :func:`peft_keys` calls the same public functions, per component, and
each alpha follows its down matrix to ``<module>.alpha``, the module's own alpha (as
kohya's trainer and ComfyUI apply it). A component whose keys hold none of the older
spellings is left exactly as it is.
"""

from __future__ import annotations

import torch

from .spec import AdapterError

__all__ = ["peft_keys"]

_OLDER = ("lora.down.", "lora.up.", "_lora.down.", "_lora.up.", "lora_linear_layer.")
_DOWN = ".lora_A.weight"


def _renaming(path: str, component: str, names: list[str]) -> dict[str, str]:
    """``{older name: peft name}`` of one component's keys (its prefix removed), by diffusers'
    converters; the identity when none is spelled the older way."""
    if not any(mark in name for name in names for mark in _OLDER):
        return {name: name for name in names}
    from diffusers.utils import state_dict_utils as convert

    same = {name: name for name in names}  # the converters move values by key: the values say where each went
    try:
        if component.startswith("text_encoder"):
            moved = convert.convert_state_dict_to_peft(convert.convert_state_dict_to_diffusers(same))
        else:
            moved = convert.convert_unet_state_dict_to_peft(same)
    except ValueError as exc:
        raise AdapterError(f"{path}: diffusers cannot rename the {component} keys to peft's ({exc}); diffusers' "
                           "own loader refuses this file too") from None
    if len(moved) != len(same):
        raise AdapterError(f"{path}: diffusers' renaming of the {component} keys gives two keys one name")
    left = sorted(old for new, old in moved.items() if any(mark in new for mark in _OLDER))
    if left:
        raise AdapterError(
            f"{path}: diffusers leaves {len(left)} {component} key(s) in its older spelling ({component}.{left[0]}"
            f"{', ...' if len(left) > 1 else ''}), which its own loader cannot load either; pass convert='native' "
            "with key rules to read the file without diffusers"
        )
    return {old: new for new, old in moved.items()}


def _down_keys_under(renamed: dict[str, str]) -> dict[str, list[str]]:
    """Each dotted prefix of an older down key -> the peft down keys under it."""
    under: dict[str, list[str]] = {}
    for old, new in renamed.items():
        if new.endswith(_DOWN):
            parts = old.split(".")
            for end in range(1, len(parts)):
                under.setdefault(".".join(parts[:end]), []).append(new)
    return under


def _alpha_key(stem: str, renamed: dict[str, str], under: dict[str, list[str]]) -> str:
    """Where the alpha ``<stem>.alpha`` goes: ``<module>.alpha`` of the module its down
    matrix now names (``stem`` is the down key, or the module in the older spelling; a
    stem that names no one down matrix keeps its key, for the reader to judge)."""
    down = renamed.get(stem)
    if down is None and len(under.get(stem, ())) == 1:
        down = under[stem][0]
    if down is not None and down.endswith(_DOWN):
        return f"{down.removesuffix(_DOWN)}.alpha"
    return f"{stem}.alpha"


def peft_keys(path: str, state: dict, alphas: dict) -> dict:
    """``state`` (keys ``<component>.<name>``, from ``lora_state_dict``, the merge's components
    only) in peft's keys, with ``alphas`` (numbers or tensors, as it returns them) beside it
    as ``<module>.alpha``; the alphas of a component left as it is keep their keys."""
    by_component: dict[str, list[str]] = {}
    for key in state:
        component, _, name = key.partition(".")
        by_component.setdefault(component, []).append(name)
    renamed: dict[str, str] = {}  # old full key -> new full key, in the components renamed
    for component, names in by_component.items():
        pairs = _renaming(path, component, names).items()
        renamed.update({f"{component}.{old}": f"{component}.{new}" for old, new in pairs if old != new})
    out = {renamed.get(key, key): value for key, value in state.items()}
    under = _down_keys_under(renamed)
    renamed_components = {key.partition(".")[0] for key in renamed}
    for key, value in alphas.items():
        stem = key.removesuffix(".alpha")
        name = _alpha_key(stem, renamed, under) if stem.partition(".")[0] in renamed_components else key
        value = value if torch.is_tensor(value) else torch.tensor(float(value))
        if name in out and not torch.equal(out[name].float(), value.float()):
            raise AdapterError(f"{path}: two alphas for {name.removesuffix('.alpha')} ({key} and another, "
                               f"{float(out[name])} against {float(value)}); remove one")
        out[name] = value
    return out
