"""What a combination's key says of its adapters: what they do to the model, not who read them.

One adapter file reaches a merge through different readers: ``hostmem lora merge`` reads
it against the checkpoint with this package's parsers, ``lora_cache.merge`` of a
diffusers model and ``load_lora`` through diffusers' converter (and from a conversion
record on a hit). Keyed by the reader's name, the same bytes were built three times
under three keys, and an image built ahead of time never served a diffusers server.

The key now covers, per adapter, its content digest (the vault's ``adapter_identity``),
the user's key rules, and the digest of its canonical form: for every target parameter
(by its name in its component), each term's scale and diff scale, written exactly
(``float.hex``), and its factors' shapes and dtypes (a LyCORIS factored term's kind, parts
and placement, :mod:`lora_cache.lycoris_math`: a LoHa never keys as a LoRA). Two readers
that place the same file's values on the same parameters with the same scales produce the
same merged bytes, and the same key; a reader that folds an alpha into the values (diffusers'
converters rescale) shows as a different scale, and is keyed apart, as its bytes may
differ in the last bit. Row slices of a fused target come from the key rules, which the
key names. The values themselves are the file's (its digest), so a hit planned from a
conversion record (factors on the meta device) keys exactly as the first start did.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Mapping

from .merge_math import Delta

__all__ = ["adapter_forms"]


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


def _adapter_of(delta: Delta) -> str:
    """The adapter file a delta came from (its source is ``"<path>: '<key>'"``)."""
    return os.path.realpath(delta.source.rsplit(": ", 1)[0])


def adapter_forms(planned: Mapping[str, list[Delta]], paths: list[str]) -> list[str]:
    """For each adapter of ``paths`` (in order), the digest of its canonical form in ``planned``
    (``{parameter name: deltas}``, the names as the vault stores the layers)."""
    forms: dict[str, list] = {os.path.realpath(p): [] for p in paths}
    for name in sorted(planned):
        for delta in planned[name]:
            forms.setdefault(_adapter_of(delta), []).append([name, _term(delta)])
    return [hashlib.sha256(json.dumps(forms[os.path.realpath(p)], separators=(",", ":")).encode()).hexdigest()
            for p in paths]
