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

import contextlib
import json
import os
import signal
import sys

from hostmem.errors import InputError


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
        "component lora.component, else the one named dit, else the streamed one).",
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


def _model(paths: list[str], shard_args: list[str]):
    """The checkpoint as a tree of read-only mapped parameters; with ``--shard``, each named
    parameter as the part a tensor-parallel rank holds (a view of the mapped whole), and
    the ``shards=`` spec that says so (None without). A bad ``--shard`` names itself."""
    from hostmem.safetensors.mapping import open_readonly
    from lora_cache.placement.layers import checkpoint_module, module_tree
    from lora_cache.ranks.tp_shards import ShardSpecError, check_shards, parse_shard_args

    if not shard_args:
        return checkpoint_module(paths), None
    spec = parse_shard_args(shard_args)
    tensors = {name: m.get_tensor(name) for m in map(open_readonly, paths) for name in m.keys()}
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
    return module_tree(tensors.items()), spec


def _check_enabled(config) -> None:
    from lora_cache.settings import DISABLE_ENV, cache_disabled_by_env

    path, lora = config.origin.path, config.lora
    if lora is None or not lora.adapters:
        raise InputError(f"{path}: lora.adapters is empty; there is nothing to merge")
    if not lora.cache.enabled:
        raise InputError(f"{path}: lora.cache.enabled is false; set it to true to build the cache")
    if cache_disabled_by_env():
        raise InputError(f"{DISABLE_ENV} is set, which turns the cache off; unset it to build the cache")


def _interrupt(signum, frame) -> None:
    """Turn the first SIGINT/SIGTERM into KeyboardInterrupt; ignore later ones while the
    build seals what it has (a second signal must not tear what the first stops)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextlib.contextmanager
def _stoppable():
    """SIGINT and SIGTERM stop the build as KeyboardInterrupt; the old handlers come back after."""
    old = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _interrupted_line(exc: KeyboardInterrupt) -> str:
    sealed = getattr(exc, "sealed_layers", None)
    what = "no layer" if not sealed else f"{sealed} layer(s)"
    return (
        f"hostmem: interrupted ({exc or 'SIGINT'}): {what} sealed in the LoRA merge cache; "
        "the next start, or `hostmem lora merge` again, resumes from there"
    )


def run_merge(args) -> int:
    from lora_cache import CacheBuildError, merge
    from lora_cache.adapters.checkpoint_model import served_as
    from hostmem.vault.combinations import CACHE_DIR
    from planners.checkpoint import checkpoint_files, diffusers_class, diffusers_config
    from planners.config import load_config

    config = load_config(args.config)
    _check_enabled(config)
    component = _merge_component(config)
    model, parts = _model(checkpoint_files(component.path), args.shard)
    # read as the server's diffusers model (the class its config.json names) will read the adapters
    model = served_as(model, diffusers_class(component.path), diffusers_config(component.path))
    roots = list(config.lora.cache.roots) or None  # None: the default root
    try:
        with _stoppable():
            stats = merge(  # keyed as a server's start is: on the mapped shards that hold the targets
                model,
                _adapters(config.lora),
                cache_root=roots,
                max_size=config.lora.cache.max_size,
                progress=False if (args.no_progress or args.json) else None,
                fallback=False,
                shards=parts,
                rounding=args.rounding,
            )
    except CacheBuildError as exc:
        print(f"hostmem: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        print(_interrupted_line(exc), file=sys.stderr)
        return 130
    if args.json:
        json.dump({"config": config.origin.path, "component": component.name, **stats.to_dict()}, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(f"{config.deployment}: {component.name} <- {', '.join(stats.adapters)}")
        print(stats)
        print(f"cache: {os.path.join(stats.cache_root, CACHE_DIR, stats.cache_key)}")
        for sharding, key in stats.shard_keys.items():
            print(f"cache of {sharding}: {os.path.join(stats.cache_root, CACHE_DIR, key)}")
    return 0
