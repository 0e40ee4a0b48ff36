"""A combination: the vault key of adapters merged into a base.

What decides the merged bytes, and so the key they are cached under. ``merge``
(:mod:`lora_cache.orchestrate`) gathers it once (:class:`Combination`) and hands it to the
opening and to the shared build (:mod:`lora_cache.ranks.shared_build`); the provider's offer
(:mod:`lora_cache.provider`) keys here too, so they agree, and none of them imports another
for it. How the build sums (the merge policy) is the build's to say
(:mod:`lora_cache.kernels.policy`): it comes in as a string.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from hostmem.vault import CacheKey, cache_key
from hostmem.vault.records import CONVERSIONS
from hostmem.vault.roots import keyer
from hostmem.vault.shelf import Shelf
from hostmem.vault.safety import prepare_root, root_is_read_only

from ..adapters import Adapter, AdapterFile
from ..adapters.read_stamps import check_unchanged, keyed, reads_of
from ..terms.dora_lycoris import peft_dora_after_others
from .canonical_key import adapter_forms, adapter_meanings

__all__ = ["Combination", "kernel_roots", "inputs_but_base", "key_of"]


def _rules(spec: Adapter) -> list:
    return [list(r.values()) if isinstance(r, dict) else list(r) for r in spec.rules]


def _key_extras(spec: Adapter, form: str) -> dict:
    """Where an adapter's meaning is not known (see :func:`_identity`): the inputs of the
    merged bytes that the file's content hash does not cover, the user's key rules and the
    canonical form's digest (:mod:`lora_cache.key.canonical_key`)."""
    return {"rules": _rules(spec), "form": form}


_MEANINGS: dict[str, str] = {}  # memo name -> meaning, in this process
_RECORDED: set[tuple[str, str]] = set()  # (memo name, cache folder): recorded there, seen by this process
_MEANING_FORMAT, _MEANING_VERSION = "lora-cache-adapter-meaning", 1


def _meaning_name(file_digest: str, form: str, adapter: AdapterFile, spec: Adapter) -> str:
    """What a meaning is remembered by: the file's content, its form (targets, scales,
    shapes), its reader (a converter's values may differ from the file's) and the key rules
    (which rows of a fused factor land where)."""
    inputs = {"digest": file_digest, "form": form, "reader": adapter.key_extras, "rules": _rules(spec)}
    return "meaning-" + hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()


def _in_roots(vaults) -> tuple:
    """``(keyer, vaults)`` of one vault or a start's roots in order: the keyer (the first
    writable, whose memo of digests the key is computed with, as ``merge``'s) and every
    root, whose records of adapters' meanings are read (an image's included)."""
    vaults = list(vaults) if isinstance(vaults, (list, tuple)) else [vaults]
    return keyer(vaults), vaults


def _remembered(vaults: list, names: list[str]) -> list[str | None]:
    shelf = Shelf(vaults, CONVERSIONS)
    valid = (lambda r: isinstance(r, dict) and r.get("format") == _MEANING_FORMAT
             and r.get("version") == _MEANING_VERSION and isinstance(r.get("meaning"), str))
    out = []
    for name in names:
        if name not in _MEANINGS:
            record = shelf.load(name, valid)
            if record is not None:
                _MEANINGS[name] = record["meaning"]
        out.append(_MEANINGS.get(name))
    return out


def _remember(vaults: list, name: str, file_digest: str, meaning: str) -> None:
    """Keep a meaning in this process and, as a record of the file (pruned with it), in the
    first writable root, once per root and process: a start on another root than the one
    this process first recorded it in records it there too (a hint: a root that cannot
    hold it costs the next start a hash of the values)."""
    _MEANINGS[name] = meaning
    shelf = Shelf(vaults, CONVERSIONS)
    if shelf.writable is None or (name, shelf.writable.cache) in _RECORDED:
        return
    _RECORDED.add((name, shelf.writable.cache))  # tried once per root and process (a failed write is said once)
    record = {"format": _MEANING_FORMAT, "version": _MEANING_VERSION, "digest": file_digest, "meaning": meaning}
    if Shelf([shelf.writable], CONVERSIONS).load(name, record.__eq__) is None:
        shelf.store(name, record)


def _identities(roots, files, specs, planned) -> list[dict]:
    """Each adapter's identity in the key: its meaning (``digest``; the file's content digest
    beside it as ``file_digest``, which the key leaves out), its strength and alpha override;
    where the meaning is neither remembered nor computable (values on the meta device), the
    file's content digest with the key rules and the form. ``roots``: a vault, or the
    start's roots in order (meanings are read from every one: an image's records name
    what its combinations were keyed by)."""
    vault, vaults = _in_roots(roots)
    paths = [f.path for f in files]
    forms = adapter_forms(planned, paths)
    found = [vault.adapter_identity(f.path, s.strength, s.alpha) for f, s in zip(files, specs)]
    for f, identity in zip(files, found):
        keyed(f.path, identity)
    check_unchanged(reads_of(f.values_check for f in files))  # the files digested are the files read
    names = [_meaning_name(i["digest"], form, f, s) for i, form, f, s in zip(found, forms, files, specs)]
    meanings = adapter_meanings(planned, paths, _remembered(vaults, names))
    out = []
    for identity, spec, form, name, meaning in zip(found, specs, forms, names, meanings):
        if meaning is None:
            out.append({**identity, **_key_extras(spec, form)})
            continue
        _remember(vaults, name, identity["digest"], meaning)
        out.append({**identity, "file_digest": identity["digest"], "digest": meaning})
    return out


def inputs_but_base(roots, files, specs, dtypes, policy: str, *, planned) -> tuple[list[dict], str, str]:
    """``(adapter identities, target dtype, merge policy)``: the key's inputs besides the base
    (``roots``: a vault, or the start's roots in order; see :func:`_identities`).
    ``planned``: ``{layer name: deltas}`` of every target, the canonical form the key covers;
    ``policy``: how the build sums, as it says it (:func:`lora_cache.kernels.policy.merge_policy`)."""
    identities = _identities(roots, files, specs, planned)
    target_dtype = ",".join(sorted({str(d).removeprefix("torch.") for d in dtypes}))
    # a peft DoRA after another term norms the base alone (merge_math.add_terms): keyed apart from
    # builds that took the weight the terms before it made, which a start must never be served
    dora = any(peft_dora_after_others(deltas) for deltas in planned.values())
    return identities, target_dtype, policy + ("+dora-norm=base" if dora else "")


def key_of(roots, files: list[AdapterFile], specs: list[Adapter], shards: list[str], dtypes, policy: str, *,
           planned) -> CacheKey:
    """The vault key of merging ``files`` (as ``specs`` ask) into the checkpoint ``shards``
    (the ones holding the targets: :func:`lora_cache.key.base_shards.base_shards`) by
    ``policy``; ``planned`` the targets' deltas by layer name (:mod:`lora_cache.key.canonical_key`);
    ``roots``: a vault, or the start's roots in order (:func:`_identities`)."""
    return cache_key(_in_roots(roots)[0].base_identity(shards), *inputs_but_base(roots, files, specs, dtypes, policy,
                                                                                 planned=planned))


@dataclass(frozen=True)
class Combination:
    """What a combination's key covers besides the base, gathered once by the merge and
    handed down: the adapters read (``files``) as the user asked for them (``specs``: each
    one's strength, alpha and key rules), the target dtypes, the policy the build sums by,
    and the canonical form (``planned``: each target's deltas, their scales final). The
    opening and a shared build key from this one value; neither goes back to the adapters,
    the strengths or the build for it."""

    files: list
    specs: list
    dtypes: frozenset
    policy: str
    planned: dict = field(repr=False)

    def inputs_but_base(self, roots) -> tuple[list[dict], str, str]:
        """:func:`inputs_but_base` of this combination (``roots``: a vault or the start's roots)."""
        return inputs_but_base(roots, self.files, self.specs, self.dtypes, self.policy, planned=self.planned)

    def key(self, roots, shards: list[str]) -> CacheKey:
        """The vault key of this combination on the checkpoint ``shards`` (``roots``: a vault or the start's roots)."""
        return key_of(roots, self.files, self.specs, shards, self.dtypes, self.policy, planned=self.planned)


def kernel_roots(roots: list[str] | None) -> list[str]:
    """The roots whose kernel timings a combination's key is made with, in the order
    their recorded choices are asked: every root but the first writable one, in list
    order (their recorded choices win: the keys of what they hold were made with them,
    so a server whose own root comes first still makes the key of an image
    ``hostmem lora merge`` wrote into a root after it), then that writable root, which
    keeps new timings (none without roots; without a writable root, new timings stay in
    this process). Every entry point asks here (``merge``, ``set_adapters``), so they
    choose the same kernels, and so the same key.

    Each root is checked first as its vault will check it: a refused root (a link to
    tmpfs, another user's folder) is refused before the timings and their lock are
    written in it.
    """
    others, keeper = [], None
    for root in roots or []:
        read_only = root_is_read_only(root)
        prepare_root(root, create=not read_only)
        if read_only or keeper is not None:
            others.append(root)
        else:
            keeper = root
    if keeper is None:
        return [*others, None] if others else []
    return [*others, keeper]
