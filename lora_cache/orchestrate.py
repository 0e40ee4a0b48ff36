"""Merging a model layer by layer: get from the vault, else put(compute), else in place.

:func:`merge` is the entry point (re-exported as ``lora_cache.merge``). Per layer it
asks the vault for the merged weight; on a miss it computes it and puts it; when the
vault cannot write it, that one layer falls back to the in-place merge; then the
result is installed. One layer at a time, through one reused output buffer that the
vault streams to disk as it fills (plus one fp32 scratch for layers that need it), so
the anonymous high-water mark stays one layer wide.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch
from tqdm import tqdm

from hostmem.safetensors_header import read_header
from hostmem.units import format_rate, format_size

from .adapters import Adapter, AdapterFile, as_adapter, read_adapter
from .handoff import Handoff
from .keys import ModuleIndex, plan_deltas
from .layers import (
    AddressSpace,
    LayerTarget,
    Snapshot,
    components_of,
    compute_merged,
    install,
    is_merged,
    merge_in_place,
    named_parameters,
    unmerge,
)
from .merge_math import Scratch, compute_device, sums_in_output
from .switch import cache_disabled_by_env
from .vault import CacheKey, Vault, base_identity, cache_key

__all__ = [
    "CacheBuildError",
    "MergeStats",
    "merge",
    "merge_layers",
    "plan_targets",
    "MERGE_POLICY",
    "merge_policy",
    "base_shards",
    "combination_key",
]

MERGE_POLICY = "fp32-sum-in-row-blocks-in-adapter-order-cast-once-v3"  # change when merged bytes would change


def merge_policy(device: torch.device | str | None = None) -> str:
    """The merge policy as the key records it: :data:`MERGE_POLICY` on the compute device's type.

    The same fp32 sum can round differently on a GPU (its addmm) and on the CPU, so a
    cache built on one is never served to starts that merge on the other.
    """
    device = torch.device(device) if device is not None else compute_device()
    return f"{MERGE_POLICY}@{device.type}"


class CacheBuildError(RuntimeError):
    """The vault could not store a layer and falling back in place was not allowed."""


@dataclass
class MergeStats:
    """What a merge did, for the planner's report. Sizes are bytes, times seconds."""

    layers: int = 0
    hit: int = 0
    built: int = 0
    fallen_back: int = 0
    in_place: int = 0
    bytes: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    cache_key: str | None = None
    cache_root: str | None = None
    adapters: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        """Merged bytes per second over the whole merge."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "rate_bytes_per_s": self.rate}

    def __str__(self) -> str:
        where = f"cache {self.cache_key[:12]}" if self.cache_key else "in place"
        return (
            f"lora merge ({where}): {self.layers} layers, {self.hit} hit, {self.built} built, "
            f"{self.fallen_back} fallen back, {self.in_place} in place; {format_size(self.bytes)} "
            f"merged, {format_size(self.bytes_written)} written in {self.seconds:.1f} s "
            f"({format_rate(self.rate)})"
        )


def plan_targets(model, adapters) -> tuple[list[LayerTarget], list[AdapterFile]]:
    """Read the adapters and resolve their keys against ``model``: the layers to merge."""
    adapters = [as_adapter(a) for a in adapters]
    params = named_parameters(model)
    shapes = {name: tuple(module._parameters[attr].shape) for name, (module, attr) in params.items()}
    components = tuple(c for c in components_of(model) if c)
    files = [read_adapter(spec.path) for spec in adapters]
    planned = plan_deltas(list(zip(files, adapters)), ModuleIndex(shapes, components))
    targets = [LayerTarget(name, *params[name], deltas) for name, deltas in planned.items()]
    for target in targets:
        if not target.current.is_floating_point():
            raise ValueError(
                f"{target.deltas[0].source} changes {target.name!r}, which is {target.current.dtype}: "
                "lora_cache merges into floating-point weights only (dequantize the base first)"
            )
    return targets, files


class _Write(NamedTuple):
    """A layer on its way to the vault: the put in flight and the handoff it reads."""

    target: LayerTarget
    written: Future
    handoff: Handoff


class _LayerLoop:
    """One merge's per-layer work, with the buffers it reuses and the figures it keeps.

    Cache hits are taken first; the misses are then built through one output buffer
    that a writer thread streams to the vault as it fills (see
    :mod:`lora_cache.handoff`): the block workers sum layer i's row blocks into it in
    order, the writer puts each finished stretch on disk while the rest is summed, and
    layer i+1's blocks reuse each stretch once layer i has written it. The disk and the
    arithmetic overlap, and the anonymous memory stays one layer wide (the output
    buffer, plus an fp32 scratch for layers that cannot sum in their output). Vault
    calls never run concurrently: gets all happen before the first put, and puts run one
    at a time, in order.
    """

    def __init__(self, targets, session, device, progress, fallback):
        self.session, self.fallback = session, fallback
        self.stats = MergeStats(layers=len(targets))
        self.space = AddressSpace()
        self.work, self.out = Scratch(device), Scratch("cpu")
        self.bar = tqdm(total=sum(t.nbytes for t in targets), unit="B", unit_scale=True, unit_divisor=1024,
                        desc="lora merge", disable=None if progress is None else not progress, leave=False)

    def record(self, target: LayerTarget, outcome: str) -> None:
        if outcome == "fallen_back" and not self.stats.fallen_back:
            warnings.warn(f"{_vault_reason(self.session)}. Merging in place instead.")
        setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)
        self.stats.bytes += target.nbytes
        self.bar.update(target.nbytes)
        self.bar.set_postfix(hit=self.stats.hit, built=self.stats.built, fallback=self.stats.fallen_back, refresh=False)

    def take_hit(self, target: LayerTarget) -> bool:
        """Install the vault's copy of ``target`` if it has one."""
        base = target.current
        view = self.session.get(target.name, tuple(base.shape), base.dtype)
        if view is not None:
            install(target, view, Snapshot(original=base))
            self.record(target, "hit")
        return view is not None

    def in_place(self, target: LayerTarget, outcome: str = "in_place", merged: torch.Tensor | None = None) -> None:
        base = target.current
        if merged is None:
            merged = compute_merged(target, self.out.take(tuple(base.shape), base.dtype).to(base.device), self.work)
        merge_in_place(target, merged, self.space.is_writable(base))
        self.record(target, outcome)

    def settle(self, pending: list[_Write]) -> None:
        """Install what the vault wrote for the oldest pending layer, or fall back in place.

        A failed put means every later one fails too (the session stops writing), so the
        writes behind it are awaited first: then no put reads the output buffer, which
        the fallback merges in.
        """
        target, written, _ = pending.pop(0)
        view = written.result()
        if view is not None:
            install(target, view, Snapshot(original=target.current))
            self.record(target, "built")
            return
        for later in pending:
            later.written.exception()  # waits; its outcome is settled in its own turn
        self.fall_back(target)

    def fall_back(self, target: LayerTarget) -> None:
        """Merge ``target`` in place because the vault cannot store it, where that is allowed."""
        if not self.fallback:
            raise CacheBuildError(
                f"the LoRA merge cache could not store {target.name!r} ({format_size(target.nbytes)}): "
                f"{_vault_reason(self.session)}. Nothing was merged in place; the model is left as it was."
            )
        self.in_place(target, "fallen_back")

    def reserve(self, targets: list[LayerTarget]) -> None:
        """Size the buffers for the largest layer once, so a layer never regrows them.

        The fp32 scratch is only reserved where some layer sums in it (see
        :func:`~lora_cache.merge_math.sums_in_output`); address space only, either way:
        pages are touched as layers fill them.
        """
        out_bytes = max((t.nbytes for t in targets), default=0)
        self.out.reserve(out_bytes)
        in_scratch = [t for t in targets if not self._sums_in_output(t)]
        self.work.reserve(max((t.current.numel() for t in in_scratch), default=0) * 4)

    def _sums_in_output(self, target: LayerTarget) -> bool:
        base = target.current
        return sums_in_output(base, target.deltas, self.out.take(tuple(base.shape), base.dtype), self.work.device)

    def build(self, targets: list[LayerTarget]) -> None:
        """Compute and put every target, the writer streaming each layer as it is summed.

        At most two layers are in flight: the one being summed and the one before it,
        whose put may still be writing its last stretch, sealing or mapping.
        """
        if not targets:
            return
        self.reserve(targets)
        pending: list[_Write] = []
        # Leaving the executors waits for the work in flight, also when an error ends the loop.
        with _block_workers(self.work.device) as workers, ThreadPoolExecutor(1, "lora-cache-write") as writer:
            for target in targets:
                if not self.session.writable:  # a put failed: the rest merges in place
                    while pending:
                        self.settle(pending)
                    self.fall_back(target)
                    continue
                pending.append(self.stream(target, writer, workers, pending[-1].handoff if pending else None))
                if len(pending) > 1:
                    self.settle(pending)
            while pending:
                self.settle(pending)

    def stream(self, target: LayerTarget, writer, workers, previous: Handoff | None) -> _Write:
        """Sum ``target`` into the output buffer while ``writer`` puts it, stretch by stretch.

        Each row block waits until the previous layer's put has written the bytes it
        overwrites. Returns once the sum is done; the put may still be running.
        """
        base = target.current
        out = self.out.take(tuple(base.shape), base.dtype)
        handoff = Handoff(target.nbytes)
        written = writer.submit(self.session.put, target.name, out, None, handoff)
        try:
            compute_merged(target, out, self.work, workers,
                           claim=None if previous is None else previous.wait_released, publish=handoff.publish)
        except BaseException:
            handoff.cancel()  # the put gives up and removes its temporary file
            raise
        handoff.publish(target.nbytes)
        return _Write(target, written, handoff)

    def run(self, targets: list[LayerTarget]) -> MergeStats:
        start = time.monotonic()
        try:
            if self.session is None:
                cached = []
            else:  # the vault holds host memory only: device weights merge in place
                cached = [t for t in targets if t.current.device.type == "cpu"]
            in_place = [t for t in targets if t not in cached]
            self.reserve(in_place)
            for target in in_place:
                self.in_place(target)
            self.build([t for t in cached if not self.take_hit(t)])
        finally:
            self.bar.close()
            self.work.release()
            self.out.release()
            _return_freed_memory()
        self.stats.seconds = time.monotonic() - start
        if self.session is not None:
            self.stats.bytes_written = int(self.session.stats.get("bytes_written", 0))
        return self.stats


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


_SUM_NICENESS = 10  # how much lower than the writer the sum's threads run


def _lower_priority(by: int) -> None:
    """Make the calling thread ``by`` nicer (Linux: the nice value is per thread); never raises."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def _block_workers(device: torch.device):
    """Threads that sum a layer's row blocks on the CPU, while the vault writes the last one.

    Each worker runs torch single-threaded and takes the next block when it is done, so
    the writer thread (and the vault's checksum) just share the cores with them: one
    descheduled worker delays one block, where an OpenMP pool spread over every core
    would stall at each operation's barrier. The workers run :data:`_SUM_NICENESS`
    nicer than the rest of the process, so that when a write completes the writer gets a
    core at once and hands the disk its next stretch: with the sum holding every core, a
    virtio disk was measured 8% slower, and the sum is ahead of the disk anyway. At most
    8 workers: the sum then outruns any disk. On a GPU the sum takes no CPU to speak of,
    so there are no workers. The process-wide torch thread count is restored when the
    build ends, also on an error; the workers end with it.
    """
    if device.type != "cpu":
        yield None
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(min(8, _cpu_count()), "lora-cache-sum", initializer=_lower_priority,
                                initargs=(_SUM_NICENESS,)) as workers:
            yield workers
    finally:
        torch.set_num_threads(threads)


def merge_layers(
    targets: list[LayerTarget],
    session=None,
    *,
    device: torch.device | str | None = None,
    progress: bool | None = None,
    fallback: bool = True,
) -> MergeStats:
    """Merge ``targets`` one layer at a time through ``session`` (``None``: in place).

    Per layer: the vault's copy, else put(compute), else (the vault could not store it)
    in place; ``fallback=False`` raises :class:`CacheBuildError` instead of that last step.
    """
    return _LayerLoop(targets, session, device, progress, fallback).run(targets)


def _vault_reason(session) -> str:
    """Why the vault could not store a layer, in its own words: what was needed, what was
    available, how to make room. The caller adds what it does about it."""
    reason = getattr(session, "last_error", None) or "the LoRA merge cache could not store a layer"
    return reason.rstrip(". ")


def _return_freed_memory() -> None:
    """Ask glibc to hand freed heap blocks back to the kernel (no-op elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _mapped_file(target: LayerTarget, space: AddressSpace) -> str | None:
    """The file the target's base weight is a mapped view of, or None."""
    area = space.area_of(target.current)
    path = area.path if area is not None and area.is_file else None
    if path is None or not path.startswith("/") or path.endswith(" (deleted)"):
        return None
    return path


def _dotted_suffixes(name: str) -> list[str]:
    """``a.b.c`` -> ``["a.b.c", "b.c", "c"]``."""
    parts = name.split(".")
    return [".".join(parts[i:]) for i in range(len(parts))]


def _shards_by_header(targets: list[LayerTarget], base_files: list[str]) -> set[str]:
    """The given shards whose headers hold the targets: same shape, and the same name up to
    wrapper prefixes on either side (``dit.blocks.0.w`` / ``model.blocks.0.w`` / ``blocks.0.w``).

    When a target is found in none of them (renamed on load, say), every given shard is
    kept: the key then covers more than it needs, never less.
    """
    exact: dict[str, list[tuple[str, tuple]]] = {}  # tensor name -> (shard, shape)
    ending: dict[str, list[tuple[str, tuple]]] = {}  # every dotted suffix of a tensor name -> (shard, shape)
    for path in base_files:
        for name, info in read_header(path).tensors.items():
            exact.setdefault(name, []).append((path, tuple(info.shape)))
            for suffix in _dotted_suffixes(name):
                ending.setdefault(suffix, []).append((path, tuple(info.shape)))
    found = set()
    for target in targets:
        shape = tuple(target.current.shape)
        shorter = [c for suffix in _dotted_suffixes(target.name)[1:] for c in exact.get(suffix, [])]
        candidates = ending.get(target.name, []) + shorter
        holders = {path for path, held in candidates if held == shape}
        if not holders:
            return set(base_files)
        found |= holders
    return found


def base_shards(targets: list[LayerTarget], base_files: list[str] | None, space: AddressSpace) -> list[str]:
    """The checkpoint shards that hold the targets' base weights: the base part of the key.

    Only those shards decide the merged bytes, so only they enter the key, however the
    merge learns of them, and every way gives the same set: a weight that is a view of a
    mapped file (``hostmem.load_readonly``, safetensors' own mmap, ``hostmem lora
    merge``) names its shard itself; for the others, ``base_files`` (every shard of the
    checkpoint will do) is narrowed to the shards whose headers hold them. A shard
    without targets (the norms, the embeddings) may change without losing the cache.
    """
    files, unplaced = set(), []
    for target in targets:
        path = _mapped_file(target, space)
        if path is None:
            unplaced.append(target)
        else:
            files.add(path)
    if unplaced and base_files is None:
        names = [t.name for t in unplaced]
        raise ValueError(
            f"cannot tell which checkpoint {len(names)} weight(s) come from ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''}): they are not views of a mapped file. Pass "
            "base_files=[the .safetensors shards the model was loaded from], or cache_root=None to merge in place"
        )
    if unplaced:
        files |= _shards_by_header(unplaced, [os.path.realpath(os.fspath(p)) for p in base_files])
    return sorted(files)


def _key_extras(adapter: AdapterFile, spec: Adapter) -> dict:
    """Inputs of the merged bytes that the adapter file's content hash does not cover."""
    config = asdict(adapter.config) if adapter.config is not None else None
    rules = [list(r.values()) if isinstance(r, dict) else list(r) for r in spec.rules]
    return {"rules": rules, "rslora": spec.rslora, "peft_config": config}


def combination_key(
    vault, files: list[AdapterFile], specs: list[Adapter], shards: list[str], dtypes, device=None
) -> CacheKey:
    """The vault key of merging ``files`` (as ``specs`` ask) into the checkpoint ``shards``
    (the ones holding the targets: :func:`base_shards`), summed on ``device``
    (default: the compute device, see :func:`merge_policy`)."""
    identities = [
        {**vault.adapter_identity(f.path, s.strength, s.alpha), **_key_extras(f, s)} for f, s in zip(files, specs)
    ]
    target_dtype = ",".join(sorted({str(d).removeprefix("torch.") for d in dtypes}))
    return cache_key(base_identity(shards), identities, target_dtype, merge_policy(device))


def _open_session(targets, files, specs, cache_root, max_size, base_files, device):
    """Open the vault for this combination: ``(key hex, session context)``."""
    shards = base_shards(targets, base_files, AddressSpace())
    vault = Vault(os.path.expanduser(os.fspath(cache_root)), max_size)
    key = combination_key(vault, files, specs, shards, {t.current.dtype for t in targets}, device)
    expected = {t.name: (tuple(t.current.shape), t.current.dtype) for t in targets}
    return key.hex, vault.open(key, expected)


def merge(
    model,
    adapters,
    cache_root: str | os.PathLike | None = None,
    *,
    base_files: list[str] | None = None,
    max_size: int | str | None = None,
    enabled: bool = True,
    device: torch.device | str | None = None,
    progress: bool | None = None,
    fallback: bool = True,
) -> MergeStats:
    """Merge ``adapters`` into ``model`` and return what it took.

    ``model`` is an ``nn.Module`` or a dict of named modules; ``adapters`` a list of
    paths, ``(path, strength)`` tuples, config dicts or :class:`lora_cache.Adapter`.
    With ``cache_root`` (and ``enabled``, and no ``HOSTMEM_DISABLE_LORA_MERGE_CACHE=1``)
    every merged weight is written once under it and installed as a read-only mapped
    view, so it stays file-backed and the next start with the same inputs reads it
    back; otherwise every layer is merged in place. ``base_files`` names the checkpoint
    shards when the weights are not mapped from them (every shard will do: the key
    covers the ones holding the merged weights, see :func:`base_shards`). ``device`` is
    where the sum runs (default: the GPU when there is one); it is part of the key.
    ``fallback=False`` raises instead of merging in place when the cache cannot store a
    layer (for ahead-of-time builds). The merged weights are views of the cache's files;
    while any of them lives, the combination counts as in use and is never evicted.

    >>> stats = lora_cache.merge(dit, [("turbo.safetensors", 1.0)], cache_root="~/.cache/hostmem")  # doctest: +SKIP
    >>> lora_cache.unmerge(dit)                                                                       # doctest: +SKIP
    """
    if is_merged(model):
        raise ValueError("the model is already merged; call lora_cache.unmerge(model) before merging again")
    specs = [as_adapter(a) for a in adapters]
    targets, files = plan_targets(model, specs)
    use_cache = cache_root is not None and enabled and not cache_disabled_by_env()
    key, cache_targets = None, [t for t in targets if t.current.device.type == "cpu"]
    session_cm = contextlib.nullcontext()
    if use_cache and cache_targets:
        key, session_cm = _open_session(cache_targets, files, specs, cache_root, max_size, base_files, device)
    try:
        with session_cm as session:
            stats = merge_layers(targets, session, device=device, progress=progress, fallback=fallback)
    except BaseException:
        unmerge(model)  # a failed merge leaves the model as it found it
        raise
    stats.cache_key = key
    stats.cache_root = os.path.expanduser(os.fspath(cache_root)) if key else None
    stats.adapters = [f.path for f in files]
    return stats
