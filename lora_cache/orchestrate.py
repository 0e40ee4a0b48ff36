"""Merging a model layer by layer: get from the vault, else put(compute), else in place.

:func:`merge` is the entry point (re-exported as ``lora_cache.merge``). Per layer it
asks the vault for the merged weight; on a miss it computes it and puts it; when the
vault cannot write it, that one layer falls back to the in-place merge; then the
result is installed. One layer at a time, through one reused output buffer that the
vault streams to disk as it fills (plus fp32 blocks for layers summed in fp32), so
the anonymous high-water mark stays one layer wide.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import warnings
from typing import NamedTuple

import torch

from hostmem.errors import InputError

from .adapters import AdapterFile, as_adapters, read_adapters
from .adapters.conversion_memo import ValuesNeeded
from .key.base_shards import base_positions, base_shards, unkeyed_reason
from .key.load_folder import loaded_from
from .key.combination import Combination, kernel_roots, key_of
from .kernels import KernelPlan, plan_for_targets
from .kernels.policy import MERGE_POLICY, merge_policy
from .kernels.precision import fp32_matmul_precision
from .targets.keys import ModuleIndex, plan_deltas
from .targets.peft_layers import refuse_peft_layers
from .layer_loop import CacheBuildError, MergeStats, cyclic_gc_paused, merge_layers
from .placement.layers import is_merged, keep_base, unmerge
from .placement.runtime_lora import remove_runtime
from .targets.layer_target import AddressSpace, LayerTarget, components_of, named_parameters
from .compute.merge_math import compute_device
from .placement.rounding import check_policy, decide, has_values, is_stand_in, say, split_lossy
from .placement.rounding_memo import RoundingSplit
from .placement.runtime_lora import apply_runtime
from .ranks.process_group import DEFAULT_TIMEOUT, check_rank_timeout, distributed_group
from .settings import DISABLE_ENV, cache_disabled_by_env
from .ranks.tp_shards import check_shards, full_shapes, shape_notes, split_shards
from hostmem.vault import Vault, VaultSession, cache_key
from hostmem.vault.behind import wait_sealed
from hostmem.vault.fold import FoldedSession, plan_fold, wait_for_a_folded_build
from hostmem.vault.roots import cache_roots, keyer, open_in_roots

__all__ = [
    "CacheBuildError",
    "MergeStats",
    "merge",
    "merge_layers",
    "wait_sealed",
    "open_combination",
    "OpenCombination",
    "plan_targets",
    "MERGE_POLICY",
    "merge_policy",
    "base_shards",
    "combination_key",
]

def _warn_if_narrowed(device) -> None:
    """Say so where this process lets torch narrow the merge's fp32 matmuls: the merged
    weights then differ from a build with torch's defaults, and are cached apart."""
    kind = (torch.device(device) if device is not None else compute_device()).type
    narrowed = fp32_matmul_precision(kind)
    if narrowed != "ieee":
        warnings.warn(
            f"torch runs fp32 matmuls as {narrowed} on {kind} in this process (torch.set_float32_matmul_precision, "
            "allow_tf32 or fp32_precision), the merge's sums included: these merged weights are cached apart from "
            "builds with torch's defaults, and a cache built ahead of time with them (hostmem lora merge, an image) "
            "is not used; set it after lora_cache.merge to merge in IEEE fp32 and share those builds", stacklevel=3)


def plan_targets(model, adapters, shards=None, memo_roots=None) -> tuple[list[LayerTarget], list[AdapterFile]]:
    """Read the adapters and resolve their keys against ``model``: the layers to merge.

    ``shards`` (:func:`merge`'s): parameters the model holds a part of are resolved
    against their whole shapes, and their targets carry the part (``target.shard``). A
    model holding peft/diffusers LoRA layers is refused first, naming them.
    ``memo_roots``: the cache roots whose conversion records spare a converted adapter's
    conversion (:func:`lora_cache.adapters.read_adapters`)."""
    adapters = as_adapters(adapters)
    refuse_peft_layers(model)  # peft moved its Linears to base_layer: every key would match no module
    params = named_parameters(model)
    shapes = {name: tuple(module._parameters[attr].shape) for name, (module, attr) in params.items()}
    held = check_shards(shards, shapes) if shards is not None else {}
    components = tuple(c for c in components_of(model) if c)
    files = read_adapters(model, adapters, memo_roots=memo_roots)  # diffusers models: through diffusers' converter
    index = ModuleIndex(full_shapes(shapes, held), components, shape_notes(shapes, held))
    planned = plan_deltas(list(zip(files, adapters)), index)
    targets = [LayerTarget(name, *params[name], deltas, shard=held.get(name)) for name, deltas in planned.items()]
    if shards is None:
        _name_in_component(targets, components)
    for target in targets:
        if not target.current.is_floating_point():
            raise InputError(
                f"{target.deltas[0].source} changes {target.name!r}, which is {target.current.dtype}: "
                "lora_cache merges into floating-point weights only (dequantize the base first)"
            )
    return targets, files


def _name_in_component(targets: list[LayerTarget], components: tuple[str, ...]) -> None:
    """Name the targets as their one component names them, where every target lies in the same
    component of a dict of models (a pipeline's transformer): the layers, and the key's
    canonical form, are then the ones a merge into that component alone (or into its
    checkpoint, ``hostmem lora merge``) stores, and each serves the others."""
    owners = {next((c for c in components if t.name.startswith(c + ".")), None) for t in targets}
    if len(owners) != 1 or None in owners:
        return
    (owner,) = owners
    for target in targets:
        target.name = target.name[len(owner) + 1:]


def _planned(targets: list[LayerTarget]) -> dict:
    return {t.name: t.deltas for t in targets}


def _host(targets: list[LayerTarget]) -> list[LayerTarget]:
    """The targets the vault holds: the host's (a GPU-resident weight merges where it lies)."""
    return [t for t in targets if t.current.device.type == "cpu"]


def combination_key(vault, files, specs, shards: list[str], dtypes, device=None, kernels: KernelPlan | None = None,
                    sharding: str = "", *, planned):
    """The vault key of merging ``files`` (as ``specs`` ask) into the checkpoint ``shards``
    as :func:`merge` keys it, summed on ``device`` (default: the compute device) by
    ``kernels`` (see :func:`merge_policy`); ``sharding`` names a tensor-parallel part;
    ``planned`` the targets' deltas by layer name."""
    return key_of(vault, files, specs, shards, dtypes, merge_policy(device, kernels, sharding), planned=planned)


def why_in_place(enabled: bool) -> str | None:
    """Why the cache is off for this merge, in words for the stats and the report; None when on."""
    if not enabled:
        return "the LoRA merge cache is turned off (enabled=False, or lora.cache.enabled: false)"
    if cache_disabled_by_env():
        return f"the LoRA merge cache is turned off ({DISABLE_ENV}=1)"
    return None


def _refuse_parts_at_runtime(lossy: RoundingSplit) -> None:
    """A tensor-parallel rank's part of a lossy layer is summed in its whole layer on a
    stand-in module: the run-time terms ``rounding='runtime'`` would keep for it have no
    module of the model to run on (they were listed and never hooked: the update dropped)."""
    parts = [t.name for t in lossy.decided()[1] if is_stand_in(t)]
    if parts:
        raise InputError(
            f"{len(parts)} layer(s) of this tensor-parallel rank ({', '.join(parts[:3])}"
            f"{', ...' if len(parts) > 3 else ''}) would lose a material share of their update to rounding "
            "(rounding='runtime' keeps such a layer's terms at run time, which a part of a weight cannot carry); "
            "pass rounding='merge' to merge them rounded, as diffusers' fuse_lora does. Nothing was merged")


class OpenCombination(NamedTuple):
    """A combination's vault session, opened by :func:`open_combination`.

    ``session`` is a context manager: leaving it seals what was built and releases the
    combination (its mapped layers stay in use while any of them lives). A start on a
    base not hashed yet builds under a provisional key while the base is hashed
    (:mod:`hostmem.vault.fold`): its ``key`` and ``root`` are final once the session is
    closed, as ``session.key`` and ``session.vault.root``."""

    key: str  # the combination's key, hex
    root: str  # the cache root whose vault serves it
    session: object  # hostmem.vault.VaultSession, or hostmem.vault.fold.FoldedSession


def open_combination(planned, specs, cache_root=None, *, max_size=None, base_files=None, device=None,
                     kernels: KernelPlan | None = None, sharding: str = "", rounding: str = "runtime",
                     at_runtime: frozenset[str] = frozenset(), form: dict | None = None,
                     lossy: RoundingSplit | None = None) -> OpenCombination:
    """Open the vault session of merging ``specs`` as :func:`merge` would, without merging.

    ``planned`` is what :func:`plan_targets` returned for ``specs``; only the host (CPU)
    targets are the vault's. ``cache_root``, ``max_size``, ``base_files`` and ``device``
    are :func:`merge`'s; ``kernels`` the plan the key is made with (default: the one
    :func:`merge` would choose). For a caller that drives the layers itself
    (:mod:`lora_cache.switching.adapter_switch`): ``session.complete`` says whether every layer is
    held, and :func:`merge_layers` takes the session. ``sharding``: the targets are
    tensor-parallel parts merged apart (see :func:`combination_key`). ``rounding``: the
    rounding policy (:mod:`lora_cache.placement.rounding`); ``at_runtime``: names of targets kept
    at run time, part of the key's inputs but never expected in the vault; ``form``: the
    deltas by layer name the key covers (default: the host targets'; a tensor-parallel
    rank's are the whole model's, as a single-process merge's). ``lossy``: in place of
    ``at_runtime``, the rounding split of the targets, decided from the combination's record
    where it has one, as :func:`merge` decides it.
    """
    targets, files = planned
    roots = cache_roots(cache_root)
    host = _host(targets)
    if kernels is None:
        kernels = plan_for_targets(targets, device, kernel_roots(roots))
    combination = Combination(files, specs, frozenset(t.current.dtype for t in host),
                              merge_policy(device, kernels, sharding, rounding), _planned(host) if form is None else form)
    return _open_in(targets, combination, roots, max_size=max_size, base_files=base_files, at_runtime=at_runtime,
                    lossy=lossy)


def _open_in(targets: list[LayerTarget], combination: Combination, roots: list[str], *, max_size=None,
             base_files=None, at_runtime: frozenset[str] = frozenset(),
             lossy: RoundingSplit | None = None) -> OpenCombination:
    """:func:`open_combination` of ``combination`` (gathered once by the caller) in ``roots``
    as :func:`~hostmem.vault.roots.cache_roots` gave them: :func:`merge` resolves its
    ``cache_root`` once and walks it with that list. ``lossy``: where given, it decides
    ``at_runtime`` once the key is known, from the combination's record where there is one
    (:mod:`lora_cache.placement.rounding_memo`)."""
    host = _host(targets)
    space = AddressSpace()
    shards = base_shards(host, base_files, space)
    vaults = [Vault(root, max_size) for root in roots]
    rest = combination.inputs_but_base(vaults)  # meanings recorded in any root (an image's) make the key

    def expected_layers(key_hex: str | None) -> tuple[list[LayerTarget], dict]:
        kept = at_runtime if lossy is None else lossy.kept_apart(vaults, key_hex, rest)
        stored = [t for t in host if t.name not in kept]
        return stored, {t.name: (tuple(t.current.shape), t.current.dtype) for t in stored}

    fold = plan_fold(vaults, shards, *rest)  # a new base: hashed beside the build, when no root can hold it
    if fold is not None:
        positions = base_positions(host, fold.paths, space)
        hasher = fold.start_hash(positions)  # it reads its first window while the rounding is measured
        try:
            expected = expected_layers(None)[1]
        except BaseException:
            hasher.stop()
            raise
        session = fold.open(expected, hasher, positions)
        if session is not None:
            return OpenCombination(session.key, session.vault.root, session)
    wait_for_a_folded_build(vaults, shards, rest)  # one building it still: it names it by the real key soon
    key = cache_key(keyer(vaults).base_identity(shards), *rest)  # from the memo where another start hashed it meanwhile
    vault, session = open_in_roots(vaults, key, expected_layers(key.hex)[1])
    return OpenCombination(key.hex, vault.root, session)


@cyclic_gc_paused()
def merge(
    model,
    adapters,
    cache_root: str | os.PathLike | list | None = None,
    *,
    base_files: list[str] | None = None,
    max_size: int | str | None = None,
    enabled: bool = True,
    device: torch.device | str | None = None,
    progress: bool | None = None,
    fallback: bool = True,
    unmergeable: bool = False,
    rank_timeout: float = DEFAULT_TIMEOUT,
    shards: dict | None = None,
    rounding: str = "runtime",
) -> MergeStats:
    """Merge ``adapters`` into ``model`` and return what it took.

    ``model`` is an ``nn.Module`` or a dict of named modules; ``adapters`` a list of
    paths, ``(path, strength)`` tuples, config dicts or :class:`lora_cache.Adapter` (or
    one of them alone).
    Unless ``enabled=False`` or ``HOSTMEM_DISABLE_LORA_MERGE_CACHE=1`` turns the cache
    off (the stats then say so), every merged weight is written once under the cache
    root and installed as a read-only mapped view, so it stays file-backed and the next
    start with the same inputs reads it back. ``cache_root`` is one root or an ordered
    list of them (default: ``$HOSTMEM_CACHE_ROOT``, else ``~/.cache/hostmem``): a
    read-only root (baked into an image) serves a combination it holds complete and
    verified; a miss builds into the first writable root; with none, the layers merge
    in place with one warning that says why. ``base_files`` names the checkpoint
    shards when the weights are not mapped from them (every shard will do: the key
    covers the ones holding the merged weights, see :func:`base_shards`). ``device`` is
    where the sum runs (default: where each weight lies, so the CPU for every weight the
    cache holds, on a GPU host too; see :func:`lora_cache.compute.buffers.compute_device`); it is
    part of the key.
    ``fallback=False`` raises instead of merging in place when the cache cannot store a
    layer (for ahead-of-time builds). The merged weights are views of the cache's files;
    while any of them lives, the combination counts as in use and is never evicted.
    A build's layers held in the page cache are served as soon as they are written;
    making them durable and sealing the combination (its next start's hit) goes on in a
    thread of the process while the model runs (:mod:`hostmem.vault.behind`), which the
    process waits for at exit, :func:`wait_sealed` sooner.
    A layer merged in place is summed into its own weight where that is writable;
    ``unmergeable=True`` first keeps a copy of it, so that :func:`lora_cache.unmerge`
    can restore it (a cached merge never needs one). ``rank_timeout``: with a
    torch.distributed process group, the seconds a rank waits for the host's other ranks
    at each step of a shared build before it fails, naming the missing rank (see
    :mod:`lora_cache.ranks.shared_build`). ``shards``: for a tensor-parallel rank, the parts of
    weights it holds, ``{parameter name: (dim, index, count)}`` (part ``index`` of
    ``count`` along dim 0, rows, or dim 1, columns); the adapters stay the whole model's,
    and each part gets exactly its part of a single-process merge: rows as a view of the
    whole merged layer's file, columns from a file of their own whose key names the
    sharding (see :mod:`lora_cache.ranks.tp_shards`; ``stats.shard_keys`` lists those keys).
    ``rounding``: what to do with a layer whose merged weight would lose a material share
    of its update to rounding (:mod:`lora_cache.placement.rounding`): ``"runtime"`` keeps its terms
    at run time on the base, ``"merge"`` merges anyway, ``"refuse"`` raises; any loss is
    said in one line and recorded in ``stats.rounding``.

    >>> stats = lora_cache.merge(dit, [("turbo.safetensors", 1.0)], cache_root="~/.cache/hostmem")  # doctest: +SKIP
    >>> lora_cache.unmerge(dit)                                                                       # doctest: +SKIP
    """
    if is_merged(model):
        raise InputError("the model is already merged; call lora_cache.unmerge(model) before merging again")
    specs = as_adapters(adapters)
    rank_timeout = check_rank_timeout(rank_timeout)
    check_policy(rounding)
    off = why_in_place(enabled)
    roots = None if off else cache_roots(cache_root)
    if roots is not None:
        _warn_if_narrowed(device)
    # planned from conversion records where a start may be all hits (one process, whole layers)
    group = distributed_group()
    memo_roots = roots if shards is None and group is None else None
    targets, files = plan_targets(model, specs, shards, memo_roots)
    if roots is not None and base_files is None:  # weights no view of a file: the folder the model came from
        base_files = loaded_from(model, _host(targets))
    if roots is not None and (unkeyed := unkeyed_reason(_host(targets), base_files)):
        off, roots = unkeyed, None
        warnings.warn(off, stacklevel=3)
    form = _planned(_host(targets))  # what the key covers
    split = split_shards(targets, roots is not None, base_files) if shards is not None else None
    if split is not None:  # tensor-parallel parts: whole layers for rows, the columns merged apart after
        targets = split.targets
    key, root, cache_targets = None, None, _host(targets)
    session_cm = contextlib.nullcontext()
    timings = kernel_roots(roots)  # each checked before the timings are written in it
    kernels = (split.choose_kernels(device, timings) if split is not None  # timed once per machine
               else plan_for_targets(targets, device, timings))
    keyed = targets  # the key covers every target, whichever way it is then served
    # keyed once, here: the opening and a shared build take this one value and never re-key
    combination = Combination(files, specs, frozenset(t.current.dtype for t in cache_targets),
                              merge_policy(device, kernels, "", rounding), form)
    lossy = RoundingSplit(targets, rounding)  # decided from the combination's record where one is opened
    if split is not None:
        _refuse_parts_at_runtime(lossy)
    shares = None
    if roots and cache_targets:
        if group is not None:  # the ranks of a host first build the misses together
            from .ranks.shared_build import build_shares

            shares = build_shares(cache_targets, combination, roots, max_size, base_files, device, kernels,
                                  progress, rank_timeout, lossy.kept_apart_measured())
        if shares is None or shares.in_place is None:  # else the host's ranks merge in place, warned once each
            whole = shards is None and group is None  # one process, whole layers: the record decides
            key, root, session_cm = _open_in(keyed, combination, roots, max_size=max_size, base_files=base_files,
                                             lossy=lossy if whole else None,
                                             at_runtime=frozenset() if whole else lossy.kept_apart_measured())
    targets, at_runtime, check = lossy.decided()
    if isinstance(session_cm, FoldedSession):  # the one place the build's read order changes
        targets = session_cm.in_file_order(targets)
    if isinstance(session_cm, (VaultSession, FoldedSession)):  # sealed behind the start (hostmem.vault.behind)
        session_cm.seal_behind = True
    session = None
    try:
        with session_cm as session:
            stats = _merge_planned(model, specs, (targets, at_runtime, check), session, rounding=rounding,
                                   device=device, progress=progress, fallback=fallback, kernels=kernels,
                                   unmergeable=unmergeable)
    except BaseException as exc:
        remove_runtime(model)  # the terms of lossy layers kept at run time come off too
        unmerge(model, strict=False)  # a failed merge leaves the model as it found it, where it kept the base
        if isinstance(exc, KeyboardInterrupt) and session is not None:
            exc.sealed_layers = len(session.layers)  # sealed by the session's close: the next start resumes
        raise
    if session is not None:  # a folded build's key and root are known once its hash is done
        key, root = session.key, session.vault.root
        stats.sealed_behind = isinstance(session, (VaultSession, FoldedSession)) and session.stats["sealed_behind"]
    lossy.remember(key)  # measured here: the next start on this key reads the record
    stats.cache_key = key
    stats.cache_root = root
    stats.cache_off = off
    stats.adapters = [f.path for f in files]
    if shares is not None:
        shares.account(stats)
    if split is not None:
        split.finish(model, stats, functools.partial(
            _merge_apart, combination=combination, policy=functools.partial(merge_policy, device, kernels),
            roots=roots, open_options=dict(max_size=max_size, base_files=base_files),
            loop_options=dict(device=device, progress=progress, fallback=fallback, kernels=kernels,
                              unmergeable=unmergeable)))
    return stats


def _merge_planned(model, specs, planned, session, *, rounding: str = "runtime", **options) -> MergeStats:
    """:func:`merge_layers` of the targets to merge, then the lossy ones hooked at run time
    (``planned``: :func:`lora_cache.placement.rounding.split_lossy`'s three). When the targets were
    planned from conversion records (no values) and a layer must be computed, it stops
    before any weight changes: the adapters are then converted, the targets planned and
    measured again, and merged with the same key and kernels (a lossy layer is never
    stored under the default policy, so it is always such a miss)."""
    targets, at_runtime, check = planned
    try:
        stats = merge_layers(targets, session, **options)
    except ValuesNeeded:
        names = {t.name for t in targets} | {t.name for t in at_runtime}
        again = [t for t in plan_targets(model, specs)[0] if t.name in names]
        recorded = check.recorded  # the split the session was opened with stands
        targets, at_runtime, check = (decide(again, check.lost, check.measured, rounding) if recorded
                                      else split_lossy(again, rounding))
        check.recorded = recorded
        stats = merge_layers(targets, session, **options)
    if not all(map(has_values, at_runtime)):  # decided from a record, planned from conversion records
        names = {t.name for t in at_runtime}
        at_runtime = [t for t in plan_targets(model, specs)[0] if t.name in names]
    say(check)
    if at_runtime:  # a checkpoint's tree (hostmem lora merge) has no forward: they are left unbuilt
        apply_runtime([t for t in at_runtime if not is_stand_in(t)])  # refuses before hooking anything
        for target in at_runtime:
            keep_base(target)
    stats.layers += len(at_runtime)
    stats.at_runtime = len(at_runtime)
    stats.rounding = check.to_dict()
    return stats


def _merge_apart(targets, sharding: str, *, combination: Combination, policy, roots, open_options,
                 loop_options) -> MergeStats:
    """Merge tensor-parallel parts that are not a view of a whole layer through a
    combination of their own, whose key names the ``sharding`` (``policy(sharding)``) and
    covers these parts' form."""
    host = _host(targets)
    apart = dataclasses.replace(combination, dtypes=frozenset(t.current.dtype for t in host),
                                policy=policy(sharding), planned=_planned(host))
    key, root, session_cm = _open_in(targets, apart, roots, **open_options)
    with session_cm as session:
        stats = merge_layers(targets, session, **loop_options)
    stats.cache_key, stats.cache_root = session.key, session.vault.root
    return stats
