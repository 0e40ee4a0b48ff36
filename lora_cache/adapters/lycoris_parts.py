"""The parts of LyCORIS's factored changes (LoHa, LoKr, LoCon's Tucker core): which kind a
module's parts make, whether they fit together, its rank and the weight they change.

Read as LyCORIS writes them (``lycoris/modules/loha.py``, ``lokr.py``, ``locon.py``) and as
ComfyUI loads them (``comfy/weight_adapter``): the merge math is :mod:`lora_cache.terms.lycoris_math`.
A part missing, of the wrong number of dimensions or of a size the others do not multiply
with is refused here, naming the key, before anything is merged.

The scale is ``alpha / rank`` as both references give it, with the rank read where both
read it: a LoHa's ``hada_w1_b.shape[0]``; a LoKr's ``lokr_w1_b.shape[0]`` or
``lokr_w2_b.shape[0]`` for the half stored as a pair, and no alpha at all (scale 1) when
both halves are stored whole (LyCORIS's trainer sets alpha to the rank then; ComfyUI
skips it); a Tucker LoCon's ``lora_down.weight.shape[0]``. A LoKr whose two pairs have
different ranks (no LyCORIS trainer writes one: it has one ``lora_dim``) is refused:
LyCORIS would read the first rank, ComfyUI the second.
"""

from __future__ import annotations

import math

from .formats.loha import PARTS as LOHA_ROLES
from .formats.lokr import PARTS as LOKR_ROLES
from .spec import AdapterError

__all__ = ["LOHA_ROLES", "LOKR_ROLES", "ROLES", "TUCKER_ROLES", "check_parts", "kind_of", "rank_of", "shape_of"]

TUCKER_ROLES = ("mid",)  # lora_mid.weight, beside lora_up / lora_down
ROLES = frozenset((*LOHA_ROLES, *LOKR_ROLES, *TUCKER_ROLES))
_KINDS = {"hada": "LoHa", "lokr": "LoKr", "mid": "LoCon with a Tucker core"}  # lora_cache.terms.lycoris_math's names
_BESIDE = {"alpha", "dora_scale", "diff_b"}  # parts a factored change may have beside its factors


def kind_of(parts) -> str | None:
    """The factored kind a module's parts make (``LoHa``, ``LoKr``, ``LoCon with a Tucker core``),
    None for none."""
    found = {_KINDS[role.split("_")[0]] for role in parts if role in ROLES}
    return found.pop() if len(found) == 1 else (None if not found else "mixed")


def _need(path: str, keys: dict, parts: dict, role: str, beside: str, dims: tuple[int, ...]):
    tensor = parts.get(role)
    if tensor is None:
        raise AdapterError(f"{path}: {keys[beside]!r} has no {role} beside it (truncated adapter?)")
    if tensor.dim() not in dims or not tensor.is_floating_point():
        raise AdapterError(f"{path}: {keys[role]!r} is {tensor.dim()}-D {tensor.dtype} {tuple(tensor.shape)}; expected "
                           f"{' or '.join(map(str, dims))}-D floating point. Is the file a LyCORIS adapter of another kind?")
    return tensor


def _fits(path: str, keys: dict, first: str, second: str, left: int, right: int) -> None:
    if left != right:
        raise AdapterError(f"{path}: {keys[first]!r} and {keys[second]!r} do not multiply ({left} against {right}); "
                           "the file is damaged")


def _pair(path, keys, parts, a: str, b: str, core: str | None, beside: str):
    """A half stored as ``a @ b`` (or through a Tucker ``core``): its ``(rows, width)``."""
    first, second = _need(path, keys, parts, a, beside, (2,)), _need(path, keys, parts, b, beside, (2, 3, 4, 5))
    if core is not None and core in parts:
        tucker = _need(path, keys, parts, core, beside, (3, 4, 5))
        _fits(path, keys, a, core, first.shape[0], tucker.shape[0])
        _fits(path, keys, core, b, tucker.shape[1], second.shape[0])
        if second.dim() != 2:
            raise AdapterError(f"{path}: {keys[b]!r} is {second.dim()}-D beside a Tucker core; expected 2-D")
        return first.shape[1], second.shape[1] * math.prod(tucker.shape[2:])
    _fits(path, keys, a, b, first.shape[1], second.shape[0])
    return first.shape[0], math.prod(second.shape[1:])


def _loha(path: str, keys: dict, parts: dict) -> tuple[int, int]:
    beside = next(role for role in LOHA_ROLES if role in parts)
    if ("hada_t1" in parts) != ("hada_t2" in parts):
        have = "hada_t1" if "hada_t1" in parts else "hada_t2"
        raise AdapterError(f"{path}: {keys[have]!r} has no other Tucker core beside it (truncated adapter?)")
    one = _pair(path, keys, parts, "hada_w1_a", "hada_w1_b", "hada_t1", beside)
    two = _pair(path, keys, parts, "hada_w2_a", "hada_w2_b", "hada_t2", beside)
    if one != two:
        raise AdapterError(f"{path}: {keys['hada_w1_a']!r} makes a {one} change, {keys['hada_w2_a']!r} a {two} one; "
                           "a LoHa's halves are of one shape (the file is damaged)")
    return one


def _lokr_half(path: str, keys: dict, parts: dict, n: int, beside: str) -> tuple[int, int, int]:
    """``(rows, width, kernel elements)`` of half ``n``: stored whole, or as a pair."""
    whole, a, b = f"lokr_w{n}", f"lokr_w{n}_a", f"lokr_w{n}_b"
    if (whole in parts) == (a in parts or b in parts):
        raise AdapterError(f"{path}: {keys[beside]!r}'s LoKr needs {whole}, or {a} and {b}, and not both")
    if whole in parts:
        tensor = _need(path, keys, parts, whole, beside, (2, 3, 4, 5))
        return tensor.shape[0], math.prod(tensor.shape[1:]), math.prod(tensor.shape[2:])
    core = "lokr_t2" if n == 2 else None
    rows, width = _pair(path, keys, parts, a, b, core, beside)
    kernel = parts[core].shape[2:] if core in parts else parts[b].shape[2:]
    return rows, width, math.prod(kernel)


def _lokr(path: str, keys: dict, parts: dict) -> tuple[int, int]:
    beside = next(role for role in LOKR_ROLES if role in parts)
    if "lokr_t2" in parts and "lokr_w2_a" not in parts:
        raise AdapterError(f"{path}: {keys['lokr_t2']!r} has no lokr_w2_a / lokr_w2_b beside it")
    rows1, width1, kernel1 = _lokr_half(path, keys, parts, 1, beside)
    rows2, width2, _ = _lokr_half(path, keys, parts, 2, beside)
    if kernel1 != 1:
        raise AdapterError(f"{path}: {keys[beside]!r}: the LoKr's first half has a kernel; LyCORIS keeps the kernel "
                           "in its second half (lokr_w2), so the file is not one it wrote")
    if "lokr_w1_b" in parts and "lokr_w2_b" in parts and parts["lokr_w1_b"].shape[0] != parts["lokr_w2_b"].shape[0]:
        raise AdapterError(f"{path}: {keys['lokr_w1_b']!r} and {keys['lokr_w2_b']!r} have ranks "
                           f"{parts['lokr_w1_b'].shape[0]} and {parts['lokr_w2_b'].shape[0]}; LyCORIS and ComfyUI "
                           "would scale it by different ones, so it is not merged. Store one half whole")
    return rows1 * rows2, width1 * width2


def _tucker(path: str, keys: dict, parts: dict) -> tuple[int, int]:
    up = _need(path, keys, parts, "up", "mid", (3, 4, 5))
    down = _need(path, keys, parts, "down", "mid", (3, 4, 5))
    mid = _need(path, keys, parts, "mid", "mid", (3, 4, 5))
    if math.prod(up.shape[2:]) != 1 or math.prod(down.shape[2:]) != 1:
        raise AdapterError(f"{path}: {keys['mid']!r}'s lora_up and lora_down have kernels "
                           f"{tuple(up.shape[2:])} and {tuple(down.shape[2:])}; beside a Tucker core both are 1x1")
    _fits(path, keys, "up", "mid", up.shape[1], mid.shape[0])
    _fits(path, keys, "mid", "down", mid.shape[1], down.shape[0])
    return up.shape[0], down.shape[1] * math.prod(mid.shape[2:])


def check_parts(path: str, parts: dict, keys: dict) -> tuple[int, int]:
    """Refuse a factored change whose parts do not fit together (:class:`AdapterError`
    naming the key); return the ``(rows, flattened width)`` of the change they make."""
    kind = kind_of(parts)
    extra = sorted(set(parts) - ROLES - _BESIDE - ({"up", "down"} if kind == _KINDS["mid"] else set()))
    if kind == "mixed" or extra:
        named = ", ".join(keys[role] for role in sorted(parts))
        raise AdapterError(f"{path}: one module's keys mix LyCORIS kinds or other parts ({named}); a module is "
                           "one LoRA, LoHa or LoKr. The file is damaged or two adapters were joined")
    return {"LoHa": _loha, "LoKr": _lokr}.get(kind, _tucker)(path, keys, parts)


def rank_of(parts) -> int | None:
    """The rank alpha is divided by (see the module), None where no alpha applies (a LoKr
    with both halves whole)."""
    kind = kind_of(parts)
    if kind == "LoHa":
        return int(parts["hada_w1_b"].shape[0])
    if kind == "LoKr":
        pair = parts.get("lokr_w1_b", parts.get("lokr_w2_b"))
        return None if pair is None else int(pair.shape[0])
    return int(parts["down"].shape[0])


def shape_of(parts) -> tuple[int, int]:
    """The ``(rows, flattened width)`` of the change (before any placement), of parts
    :func:`check_parts` accepted."""
    return check_parts("", parts, {role: role for role in parts})
