"""What a combination's key says of its adapters: what they do to the model, not who read them.

One adapter file reaches a merge through different readers: ``hostmem lora merge`` reads
it against the checkpoint with this package's parsers, ``lora_cache.merge`` of a
diffusers model and ``load_lora`` through diffusers' converter (and from a conversion
record on a hit). Keyed by the reader's name, the same bytes were built three times
under three keys, and an image built ahead of time never served a diffusers server.

The key covers, per adapter, its meaning: the digest of its canonical form (for every
target parameter, by its name in its component, each term's scale and diff scale, written
exactly with ``float.hex``, and its factors' shapes and dtypes; a LyCORIS factored term's
kind, parts and placement, :mod:`lora_cache.terms.lycoris_math`: a LoHa never keys as a LoRA)
together with the values
each term places (the up rows a fused target takes, a padded slice included). A peft
folder and a kohya file of the same math are then one key, and the file's own content
digest is recorded beside it for people and for ``hostmem cache prune``
(``file_digest``), never keyed. The meaning is remembered by the file's content digest,
its form, its reader and the key rules (:mod:`lora_cache.key.combination`), so a start
planned from a conversion record (factors on the meta device) keys as the first start
did; where it is not remembered and the values are not at hand, the key falls back to
the file's content digest with the user's key rules and the form (a miss at worst). Two readers (or two layouts)
that place the same values on the same parameters with the same scales produce the same
merged bytes, and the same key; a reader that folds an alpha into the values (diffusers'
converters rescale) shows as a different scale and different values, and is keyed apart,
as its bytes may differ in the last bit.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Mapping

from ..terms.delta import Delta

__all__ = ["adapter_forms", "adapter_meanings"]


def _shape(tensor) -> list | None:
    return None if tensor is None else [list(tensor.shape), str(tensor.dtype).removeprefix("torch.")]


def _term(delta: Delta) -> list:
    term = [float(delta.scale).hex(), _shape(delta.up), _shape(delta.down), float(delta.diff_scale).hex(),
            _shape(delta.diff)]
    if delta.factors is not None:  # LoHa, LoKr, Tucker LoCon: the kind, each part, and where it lands
        f = delta.factors
        term += [f.kind, [[role, _shape(t)] for role, t in f.parts], list(f.shape), f.rows_from, f.span]
    if delta.magnitude is None:
        return term
    lycoris = [] if delta.dora == "peft" else [delta.dora, float(delta.dora_strength).hex()]  # dora_lycoris
    return [*term, "dora", _shape(delta.magnitude), *lycoris]


def _adapter_of(delta: Delta, resolved: dict[str, str]) -> str:
    """The adapter file a delta came from (its source is ``"<path>: '<key>'"``), resolved once
    a file into ``resolved`` (``realpath`` walks every folder of the path: once a layer, it
    cost a start thousands of ``lstat`` calls)."""
    path = delta.source.rsplit(": ", 1)[0]
    if path not in resolved:
        resolved[path] = os.path.realpath(path)
    return resolved[path]


def adapter_forms(planned: Mapping[str, list[Delta]], paths: list[str]) -> list[str]:
    """For each adapter of ``paths`` (in order), the digest of its canonical form in ``planned``
    (``{parameter name: deltas}``, the names as the vault stores the layers)."""
    forms: dict[str, list] = {os.path.realpath(p): [] for p in paths}
    resolved: dict[str, str] = {}
    for name in sorted(planned):
        for delta in planned[name]:
            forms.setdefault(_adapter_of(delta, resolved), []).append([name, _term(delta)])
    return [hashlib.sha256(json.dumps(forms[os.path.realpath(p)], separators=(",", ":")).encode()).hexdigest()
            for p in paths]


# --- the meaning: the canonical form with its values, so one math from two layouts is one key


def _values(tensor) -> str | None:
    """The digest of a tensor's values as placed (its bytes, with the shape and dtype the
    term names); None for no tensor. Raises :class:`LookupError` for a tensor without values
    (planned from a conversion record: the meta device)."""
    import torch

    if tensor is None:
        return None
    if tensor.is_meta:
        raise LookupError("no values")
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(memoryview(flat.numpy())).hexdigest()


def _meaning_of(entries: list) -> str:
    """``entries``: ``[name, term, delta]`` of one adapter; the digest of them with the values."""
    described = [[name, term, [_values(getattr(delta, part)) for part in ("up", "down", "diff", "magnitude")]
                  + ([[role, _values(t)] for role, t in delta.factors.parts] if delta.factors is not None else [])]
                 for name, term, delta in entries]  # a LyCORIS term's values are its parts
    return hashlib.sha256(json.dumps(described, separators=(",", ":")).encode()).hexdigest()


def adapter_meanings(planned: Mapping[str, list[Delta]], paths: list[str], known: list[str | None]) -> list[str | None]:
    """For each adapter of ``paths``, the digest of its canonical form with the values each
    term places (``known[i]`` where the caller remembered it: its memo), or None where the
    values are not at hand (planned from a conversion record, and not remembered)."""
    entries: dict[str, list] = {os.path.realpath(p): [] for p in paths}
    resolved: dict[str, str] = {}
    for name in sorted(planned):
        for delta in planned[name]:
            entries.setdefault(_adapter_of(delta, resolved), []).append([name, _term(delta), delta])
    out = []
    for path, remembered in zip(paths, known):
        if remembered is not None:
            out.append(remembered)
            continue
        found = entries[os.path.realpath(path)]
        try:
            out.append(_meaning_of(found) if found else None)  # no target: the file's digest tells them apart
        except LookupError:
            out.append(None)
    return out
