"""``hostmem lora merge CONFIG``: build a deployment's LoRA merge cache ahead of time.

An image build step can run it so that the first start of a server already finds
every merged layer on disk. It needs no model class: the checkpoint named by the
config is mapped read-only into a tree of parameters named like its tensors, and the
adapters are merged into it through the cache. Where the checkpoint's ``config.json``
names a diffusers model class, the adapters are read as the server's model reads them,
through diffusers' converter for that class (:mod:`lora_cache.adapters.checkpoint_model`), so the
build makes the key ``load_lora``, ``merge`` and ``set_adapters`` will look up. A layer the cache cannot store is an
error here (a build that merged in place would have built nothing).

For a tensor-parallel server, ``--shard NAME=DIM:INDEX:COUNT`` (repeated, one per
weight a rank holds a part of, as ``lora_cache.merge``'s ``shards=``) builds what that
rank maps: the command holds those parameters as their parts of the mapped checkpoint,
as the rank does, so the rows come from the whole layers' files and the columns from a
combination of their own. Run it once per rank's index to build every part.

SIGINT or SIGTERM stops the build between writes: the layers sealed so far stay, the
manifest records them, and the command exits 130 saying how many there are; the next
start (or this command again) resumes from there.
"""

from __future__ import annotations

import json
import os
import sys

from hostmem.errors import InputError

from .stopping import stoppable


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "lora",
        help="LoRA merges: build the merged-weight cache ahead of time",
        description="LoRA merges into read-only mapped weights.",
    )
    actions = parser.add_subparsers(dest="lora_action", metavar="ACTION")
    actions.required = True
    merge = actions.add_parser(
        "merge",
        help="merge the config's adapters into its checkpoint, through the cache",
        description="Build the LoRA merge cache of a deployment config (lora.adapters into the "
        "component a server's start merges into: lora.component, else the one declaring lora_targets, "
        "else the streamed one), from the weights the server loads (components.NAME.variant) at the "
        "dtype it holds them in (components.NAME.dtype).",
    )
    merge.add_argument("config", help="deployment config (YAML)")
    merge.add_argument("--json", action="store_true", help="print the build's figures as JSON (sizes in bytes)")
    merge.add_argument("--no-progress", action="store_true", help="no progress bar")
    merge.add_argument(
        "--shard", action="append", default=[], metavar="NAME=DIM:INDEX:COUNT",
        help="a tensor-parallel rank holds part INDEX of COUNT of parameter NAME along DIM (0: rows, "
        "column-parallel; 1: columns, row-parallel); repeat per parameter; builds that rank's parts",
    )
    merge.add_argument(
        "--rounding", choices=("runtime", "merge", "refuse"), default="runtime",
        help="layers whose merged weight would lose over 5%% of their LoRA update to rounding: not built, the "
        "server keeps them at run time (runtime, the default); built anyway, under a key of their own that "
        "only starts asking for it use (merge); or refuse the build (refuse)",
    )
    merge.set_defaults(run=run_merge)


def _merge_component(config):
    """The component the adapters go into: the one a server's start merges into
    (``config.merge_target``: lora.component, else the one declaring ``lora_targets``, else
    the streamed one with a checkpoint), else ``dit``."""
    chosen = config.merge_target or config.components.get("dit")
    if chosen is None:
        raise InputError(f"{config.origin.path}: no component to merge into; set lora.component")
    if not chosen.path:
        raise InputError(
            f"{config.origin.path}: components.{chosen.name} has declared sizes but no path; "
            "hostmem lora merge needs the checkpoint itself"
        )
    return chosen


def _adapters(lora):
    """The config's adapters as lora_cache.Adapter (optional fields pass through when present)."""
    from lora_cache import Adapter

    return [Adapter(a.path, a.strength, alpha=a.alpha, rules=a.rules, strict=a.strict, rslora=a.rslora)
            for a in lora.adapters]


def _model(paths: list[str], shard_args: list[str], cast: dict):
    """The checkpoint as a tree of read-only mapped parameters; with ``--shard``, each named
    parameter as the part a tensor-parallel rank holds (a view of the mapped whole), and
    the ``shards=`` spec that says so (None without). A bad ``--shard`` names itself.
    ``cast``: the weights the server holds in another dtype than the checkpoint's, {name:
    dtype}; each is a copy in that dtype (of the rank's part, with ``--shard``)."""
    from hostmem.safetensors.mapping import open_readonly
    from lora_cache.placement.layers import module_tree
    from lora_cache.ranks.tp_shards import parse_shard_args

    tensors = {name: m.get_tensor(name) for m in map(open_readonly, paths) for name in m.keys()}
    spec = parse_shard_args(shard_args) if shard_args else None
    if spec is not None:
        _take_parts(tensors, spec)
    for name, dtype in cast.items():
        tensors[name] = tensors[name].to(dtype)
    return module_tree(tensors.items()), spec


def _take_parts(tensors: dict, spec) -> None:
    """Each ``--shard`` parameter of ``tensors`` replaced by the part the rank holds."""
    from lora_cache.ranks.tp_shards import ShardSpecError, check_shards

    try:
        held = check_shards(spec, {name: tuple(t.shape) for name, t in tensors.items()})
    except ShardSpecError as exc:
        raise ShardSpecError(f"--shard: {exc}") from None
    for name, shard in held.items():
        if tensors[name].shape[shard.dim] % shard.count:
            raise ShardSpecError(
                f"--shard {name}={':'.join(map(str, spec[name]))}: {name!r} has {tensors[name].shape[shard.dim]} "
                f"along dim {shard.dim} in the checkpoint, which does not split into {shard.count} equal parts"
            )
        tensors[name] = shard.part(tensors[name])


_CASTS = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "float8_e4m3fn"}


def _served_casts(config, component, headers, model_class: str | None) -> tuple[dict, str]:
    """The LoRA targets the server holds in another dtype than the checkpoint stores, {name:
    torch dtype}, and a line saying what the build is for. The merge is keyed by the dtype
    it rounds to, so a build at the checkpoint's dtype is never found by a server that casts
    at load: with ``components.<name>.dtype`` each floating target is cast as diffusers'
    ``from_pretrained(torch_dtype=...)`` casts it (a module the model class keeps in fp32
    to fp32: :mod:`planners.kept_fp32`). A cast needs room for a copy of each target:
    refused up front where the host (or this process's memory cgroup) has not that much.
    ``model_class``: the diffusers class the checkpoint's config.json names, or None."""
    import torch

    from hostmem.units import format_size
    from planners.adapter_targets import adapter_spec
    from planners.checkpoint import diffusers_config
    from planners.headroom import read_headroom
    from planners.kept_fp32 import kept_in_fp32
    from lora_cache.provider import target_layers

    infos = {name: info for header in headers for name, info in header.tensors.items()}
    names_of = {"F32": "fp32", "F16": "fp16", "BF16": "bf16", "F8_E4M3": "fp8", "F8_E5M2": "fp8_e5m2"}
    stored = sorted({names_of.get(info.dtype, info.dtype.lower()) for info in infos.values()}) or ["?"]
    served, key = component.dtype, f"components.{component.name}.dtype"
    if served is None:
        return {}, (f"built for the checkpoint's {'/'.join(stored)} weights; a server that loads {component.name} in "
                    f"another dtype needs {key} set to it")
    if served not in _CASTS:
        raise InputError(f"{config.origin.path}: {key} is {served}, a quantization the server makes at load, not a cast "
                         "a merged cache can be built for; remove it to build for the checkpoint's weights")
    dtype, keep = getattr(torch, _CASTS[served]), kept_in_fp32(diffusers_config(component.path), served)
    roots = list(config.lora.cache.roots) or None
    names = target_layers([h.path for h in headers], [adapter_spec(a) for a in config.lora.adapters],
                          model_class=model_class, memo_roots=roots, headers=headers).names
    cast = {}
    for name in names:
        held = infos[name].torch_dtype
        wanted = torch.float32 if keep.keeps(name) else dtype
        if held.is_floating_point and held != wanted:
            cast[name] = wanted
    need = sum(infos[n].nbytes // infos[n].torch_dtype.itemsize * d.itemsize for n, d in cast.items())
    have = read_headroom().bytes
    if need > have:
        raise InputError(
            f"casting {len(cast)} LoRA target(s) of {component.name} to {served} ({key}) holds {format_size(need)} "
            f"in memory and {format_size(have)} is available; build on a host with more memory, as the server "
            "holds them too")
    kept = sum(1 for d in cast.values() if d != dtype)
    return cast, f"built for {served} weights ({key})" + (
        f", {len(cast)} target(s) cast from the checkpoint's {'/'.join(stored)}" if cast else "") + (
        f", {kept} kept in fp32 as the model class keeps them" if kept else "")


def _check_enabled(config) -> None:
    from lora_cache.settings import DISABLE_ENV, cache_disabled_by_env

    path, lora = config.origin.path, config.lora
    if lora is None or not lora.adapters:
        raise InputError(f"{path}: lora.adapters is empty; there is nothing to merge")
    if not lora.cache.enabled:
        raise InputError(f"{path}: lora.cache.enabled is false; set it to true to build the cache")
    if cache_disabled_by_env():
        raise InputError(f"{DISABLE_ENV} is set, which turns the cache off; unset it to build the cache")


def _interrupted_line(exc: KeyboardInterrupt, finished=None) -> str:
    """The one line of a build stopped by a signal; ``finished``: the stats of a build that had
    ended when the signal came (while its figures were printed)."""
    if finished is not None:
        return (f"hostmem: interrupted ({exc or 'SIGINT'}) after the build finished: {finished.layers} layer(s) "
                f"of combination {(finished.cache_key or '?')[:12]} in the LoRA merge cache; nothing is left to resume")
    sealed = getattr(exc, "sealed_layers", None)
    what = "no layer" if not sealed else f"{sealed} layer(s)"
    return (
        f"hostmem: interrupted ({exc or 'SIGINT'}): {what} sealed in the LoRA merge cache; "
        "the next start, or `hostmem lora merge` again, resumes from there"
    )


def _build(args, stop):
    """Read the config and build its merge: ``(stats, config, component, built_for)``;
    ``stop`` (:class:`.stopping.Stop`) is armed once what the build imports is imported."""
    import warnings

    from lora_cache import merge, wait_sealed
    from lora_cache.adapters.checkpoint_model import served_as
    from lora_cache.placement.rounding import RoundingWarning
    from planners.checkpoint import diffusers_class, diffusers_config, read_headers
    from planners.config import load_config

    warnings.filterwarnings("ignore", category=RoundingWarning)  # the report's own rounding line says it
    config = load_config(args.config)
    _check_enabled(config)
    component = _merge_component(config)
    headers = read_headers(component.path, component.variant)  # refuses a tensor in two files
    model_class = diffusers_class(component.path)
    if model_class is not None:  # the server's reader of the adapters: imported before a signal may raise
        import diffusers  # noqa: F401
    stop.arm()  # torch and diffusers are in: a signal stops the build at once from here (the cast, the merge)
    cast, built_for = _served_casts(config, component, headers, model_class)
    files = [header.path for header in headers]
    model, parts = _model(files, args.shard, cast)
    # read as the server's diffusers model (the class its config.json names) will read the adapters
    model = served_as(model, model_class, diffusers_config(component.path))
    stats = merge(  # keyed as a server's start is: on the mapped shards that hold the targets
        model,
        _adapters(config.lora),
        cache_root=list(config.lora.cache.roots) or None,  # None: the default root
        max_size=config.lora.cache.max_size,
        progress=False if (args.no_progress or args.json) else None,
        fallback=False,
        shards=parts,
        rounding=args.rounding,
        base_files=files,
    )
    wait_sealed()  # the image is what this command makes: sealed before it says so
    return stats, config, component, built_for


def run_merge(args) -> int:
    built: list = []  # the build's stats, once it has finished
    try:
        # from the first import on: a signal never ends the command without its line (held until the
        # imports are done, .stopping)
        with stoppable(armed=False) as stop:
            return _run(args, built, stop)
    except KeyboardInterrupt as exc:
        print(_interrupted_line(exc, built[0] if built else None), file=sys.stderr)
        return 130


def _run(args, built: list, stop) -> int:
    from hostmem.vault.combinations import CACHE_DIR
    from lora_cache import CacheBuildError

    try:
        stats, config, component, built_for = _build(args, stop)
    except CacheBuildError as exc:
        print(f"hostmem: error: {exc}", file=sys.stderr)
        return 1
    built.append(stats)
    if args.json:
        json.dump({"config": config.origin.path, "component": component.name, "built_for": built_for,
                   **stats.to_dict()}, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(f"{config.deployment}: {component.name} <- {', '.join(stats.adapters)}")
        print(stats)
        print(built_for)
        print(f"cache: {os.path.join(stats.cache_root, CACHE_DIR, stats.cache_key)}")
        for sharding, key in stats.shard_keys.items():
            print(f"cache of {sharding}: {os.path.join(stats.cache_root, CACHE_DIR, key)}")
    return 0
