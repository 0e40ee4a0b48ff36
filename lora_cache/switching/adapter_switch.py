"""Switching a live model between adapter combinations without anonymous memory.

:func:`set_adapters` moves a model to another combination (or to the base with ``[]``):

- a combination the vault holds whole is installed by re-pointing every affected
  parameter at its mapped layer files: no merge, no copy, no anonymous memory;
- a missing one is served at once at run time (:mod:`lora_cache.placement.runtime_lora`: the base
  stays mapped and untouched, each targeted Linear adds its adapter terms to its
  output) while a background thread builds it into the vault, one layer at a time, as
  ``hostmem lora merge`` does: into stand-in modules that share the base's mapped
  tensors, so the live model is never touched by the build. At the next safe point
  (the next forward call of the model, or :func:`swap_ready`) the run-time terms come
  off and the built layers go in, while no forward is running
  (:mod:`lora_cache.switching.forward_gate`).

A tensor-parallel rank passes ``shards=`` as to :func:`lora_cache.merge`: each switch is
then a merge of the rank's parts (a combination held whole is re-pointed at its mapped
files, a missing one is built before the call returns, by the host's ranks together when
a process group is initialised, so every rank switches at once). The run-time path is
not taken there: its terms would be the whole layer's, not the rank's part.

Strengths are part of a combination, so a strength change is a switch like any other.
The vault evicts least-recently-used combinations and never one a live model maps; this
module relies on that and keeps no list of its own.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from ..adapters import Adapter, as_adapters
from ..adapters.checks import check_before_use
from ..adapters.conversion_memo import ValuesNeeded
from ..key.combination import kernel_roots
from ..kernels import plan_for_targets
from ..placement.layers import is_merged
from ..targets.layer_target import LayerTarget, components_of
from ..placement.layers import keep_base, unmerge as unmerge_layers
from ..placement.rounding import say
from ..placement.rounding_memo import RoundingSplit
from .identity import combination_identity
from ..orchestrate import CacheBuildError, cache_roots, merge, merge_layers, open_combination, plan_targets
from ..ranks.process_group import DEFAULT_TIMEOUT, check_rank_timeout
from ..placement.runtime_lora import apply_runtime, remove_runtime, runtime_bytes, unsupported_reason
from .switch_state import (Pending, SwitchState, attach, detach, existing_state, rewrap, state_for_switch, state_of,
                           states_on)

__all__ = ["SwitchResult", "set_adapters", "swap_ready", "serving", "build_reserve_bytes", "unmerge"]


@dataclass
class SwitchResult:
    """What a switch did. ``mode``: ``base``, ``cached`` (re-pointed at the vault),
    ``runtime`` (served at run time while the vault builds it) or ``built`` (built now,
    because some target cannot be applied at run time). Sizes in bytes."""

    mode: str
    layers: int = 0
    seconds: float = 0.0
    runtime_bytes: int = 0
    copied_bytes: int = 0

    def __str__(self) -> str:
        return f"adapter switch: {self.mode}, {self.layers} layers in {self.seconds * 1000:.1f} ms"


class _Enter:
    """Forward pre-hook on a root module: swap if a build is ready, then enter the gate."""

    def __init__(self, state: SwitchState):
        self.state = state

    def __call__(self, module, args):
        rewrap(self.state, module)  # a hook of another library's removed since may have taken the wrapper off
        pending = self.state.pending
        if pending is not None and pending.built and not self.state.gate.in_forward:
            _swap(self.state, pending, blocking=False)
        self.state.gate.enter()


class _Leave:
    def __init__(self, state: SwitchState):
        self.state = state

    def __call__(self, module, args, output):
        self.state.gate.leave()


_BUILDER: ThreadPoolExecutor | None = None
_BUILDER_LOCK = threading.Lock()
_SWITCHING = threading.Lock()  # one switch at a time in a process: switches are rare, and shared modules meet here
_COMBINATION_LOCKS: dict[tuple, threading.Lock] = {}
_EXITING = threading.Event()  # the interpreter is exiting: a build cut short is no failure


def _builder() -> ThreadPoolExecutor:
    """The process's one build thread: builds run one at a time, in the order asked."""
    global _BUILDER
    with _BUILDER_LOCK:
        if _BUILDER is None:
            _BUILDER = ThreadPoolExecutor(1, "lora-switch-build")
            _when_exiting(_EXITING.set)
        return _BUILDER


def _when_exiting(call) -> None:
    """Run ``call`` as the interpreter begins to exit, before it joins threads and before
    concurrent.futures refuses new work (which ends a build in flight with "cannot
    schedule new futures after interpreter shutdown"): threading's own exit hook, run
    last registered first, where this Python has it."""
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        try:
            register(call)
        except RuntimeError:  # asked while the interpreter already exits
            call()


def _combination_lock(identity: tuple) -> threading.Lock:
    """Held while this process has the combination's vault session open (one per key)."""
    with _BUILDER_LOCK:
        return _COMBINATION_LOCKS.setdefault(identity, threading.Lock())


def _replace(old: SwitchState) -> None:
    """Take ``old`` to the base and off its modules (a switch of a wider set takes over)."""
    with old.gate.exclusive():
        _to_base(old)
        detach(old)


def _stand_ins(targets: list[LayerTarget]) -> list[LayerTarget]:
    """The host targets again, over the same base tensors, in throwaway modules.

    The build installs its layers into these, so it never touches the live model, and
    the base stays a view of the checkpoint's mapping (no copy). Device weights are not
    the vault's: they are merged in place at the swap, as :func:`lora_cache.merge` does.
    """
    out = []
    for target in targets:
        if target.current.device.type != "cpu":
            continue
        holder = nn.Module()
        holder.register_parameter("weight", nn.Parameter(target.current.detach(), requires_grad=False))
        out.append(LayerTarget(target.name, holder, "weight", target.deltas))
    return out


def _open(targets, files, specs, opts, kernels, lossy=()):
    """The vault session of this combination, keyed exactly as :func:`lora_cache.merge` keys it
    (``lossy``: targets kept at run time, in the key, never expected: :mod:`lora_cache.placement.rounding`;
    or the :class:`RoundingSplit` of ``targets``, which decides them from the combination's
    record where there is one, as a merge of the same combination does)."""
    options = dict(max_size=opts["max_size"], base_files=opts["base_files"], device=opts["device"], kernels=kernels)
    if isinstance(lossy, RoundingSplit):
        return open_combination((targets, files), specs, opts["cache_root"], lossy=lossy, **options).session
    return open_combination(([*targets, *lossy], files), specs, opts["cache_root"],
                            at_runtime=frozenset(t.name for t in lossy), **options).session


def _keep_at_runtime(lossy: list[LayerTarget]) -> None:
    """Serve ``lossy`` at run time on their base, as :func:`lora_cache.merge` does."""
    if lossy:
        apply_runtime(lossy)
        for target in lossy:
            keep_base(target)


def _merge_through(targets, session, opts, kernels) -> None:
    """Every host layer through the vault (hits, or built); device weights in place, restorably."""
    merge_layers(targets, session, device=opts["device"], progress=False, fallback=False, kernels=kernels,
                 unmergeable=True)


def _install_cached(state: SwitchState, identity, targets, files, specs, kernels, lossy=()) -> bool:
    """Re-point ``targets`` at the vault's layers when it holds the whole combination (and
    serve ``lossy`` at run time)."""
    lock = _combination_lock(identity)
    if not lock.acquire(blocking=False):
        return False  # the build thread has it open: it is being built
    try:
        with _open(targets, files, specs, state.options, kernels, lossy) as session:
            if not session.complete:
                return False
            if isinstance(lossy, RoundingSplit):
                targets, lossy, _ = lossy.decided()
            try:
                _merge_through(targets, session, state.options, kernels)
                _keep_at_runtime(list(lossy))
            except BaseException:
                unmerge_layers(state.components, strict=False)
                raise
        return True
    finally:
        lock.release()


def _build(state: SwitchState, pending: Pending) -> None:
    """Build ``pending`` into the vault (the build thread). Never touches the live model."""
    with _combination_lock(pending.identity):
        if state.pending is not pending or _EXITING.is_set():
            return  # switched away before the build began (build it when asked again), or exiting
        with _open(pending.stand_ins, pending.files, pending.specs, state.options, pending.kernels,
                   pending.lossy) as session:
            _merge_through(pending.stand_ins, session, state.options, pending.kernels)
    pending.stand_ins = []  # drops the stand-ins' views; the vault keeps the files


def _after_build(future: Future) -> None:
    error = future.exception()
    if error is not None and not _EXITING.is_set():  # an exit is no failure: what was sealed stays, the rest resumes
        warnings.warn(f"lora_cache: building the merged combination failed ({error}); "
                      "it stays applied at run time", stacklevel=1)


def _schedule(state: SwitchState, pending: Pending) -> None:
    pending.future = _builder().submit(_build, state, pending)
    pending.future.add_done_callback(_after_build)


def _to_base(state: SwitchState, strict: bool = True) -> int:
    """Take every adapter off: run-time terms unhooked, merged weights pointed back at the
    base, a pending build's swap dropped; how many layers went back."""
    unhooked = remove_runtime(state.components)
    restored = unmerge_layers(state.components, strict)  # every merge here keeps what restores the base
    state.pending = None
    state.identity = ()
    return unhooked + restored


def unmerge(model, strict: bool = True) -> int:
    """``lora_cache.unmerge``: back to the base, bit for bit; how many layers went back.

    :func:`lora_cache.placement.layers.unmerge` for a model merged by :func:`lora_cache.merge`. On a
    model :func:`set_adapters` switches, the run-time terms of a combination still being
    built come off too, and its swap is dropped (before, they stayed, and the swap later
    installed the adapter again), at a safe point as a switch is. A switch holds its
    model whole: on a pipeline switched as a whole (:func:`set_pipeline_adapters`), the
    unmerge of one component (``pipe.transformer``) takes every component the switch
    covers back to the base (the text encoder too), and the count includes them.
    """
    state = existing_state(model)
    if state is None:  # layers a merge kept at run time (lora_cache.placement.rounding) come off too
        remove_runtime(model)
        return unmerge_layers(model, strict)
    with state.gate.exclusive():  # the whole switched model: it serves one combination
        return _to_base(state, strict)


def _swap(state: SwitchState, pending: Pending, blocking: bool) -> bool:
    """Replace the run-time terms of ``pending`` by its built layers, at a safe point."""
    with state.gate.exclusive(blocking) as held:
        if not held or state.pending is not pending or not pending.built:
            return False
        remove_runtime(state.components)
        try:
            installed = _install_cached(state, pending.identity, pending.targets, pending.files, pending.specs,
                                        pending.kernels, pending.lossy)
        except Exception as exc:  # the model is back at the base: serve at run time again, say why
            apply_runtime(pending.targets + pending.lossy)
            pending.swap_error = exc
            warnings.warn(f"lora_cache: swapping in the merged combination failed ({exc}); "
                          "it stays applied at run time", stacklevel=1)
            return False
        if installed:
            state.pending = None
            return True
        # evicted between the build and the swap: serve at run time again and rebuild
        apply_runtime(pending.targets + pending.lossy)
        pending.stand_ins = _stand_ins(pending.targets)
        _schedule(state, pending)
        return False


def set_adapters(
    model,
    adapters,
    cache_root: str | os.PathLike | list,
    *,
    max_size: int | str | None = None,
    base_files: list[str] | None = None,
    device: torch.device | str | None = None,
    background: bool = True,
    shards: dict | None = None,
    rank_timeout: float = DEFAULT_TIMEOUT,
) -> SwitchResult:
    """Switch ``model`` to ``adapters`` (``[]``: the base) and return what it took.

    ``adapters`` is what :func:`lora_cache.merge` takes (paths, ``(path, strength)``
    tuples, dicts, :class:`lora_cache.Adapter`). A combination the vault under
    ``cache_root`` (one root, or an ordered list of them as :func:`lora_cache.merge`
    takes) holds whole is installed as mapped views; any other is applied at run
    time at once and built in the background (``background=False``: built now), then
    swapped in at the next safe point (see :func:`swap_ready`). Waits for forward calls
    in flight on other threads; raises when called from inside one. ``max_size``,
    ``base_files``, ``device``, ``shards`` (a tensor-parallel rank's parts, see the
    module's docstring) and ``rank_timeout`` (how long a rank waits for the host's others
    in a build they share) are :func:`lora_cache.merge`'s.
    """
    started = time.perf_counter()
    cache_root = tuple(cache_roots(cache_root))  # one root or an ordered list of them, as merge takes
    options = {"cache_root": cache_root, "max_size": max_size, "base_files": base_files, "device": device,
               "shards": shards, "rank_timeout": check_rank_timeout(rank_timeout)}
    roots = components_of(model)
    for other in states_on(roots):
        other.gate.refuse_inside()  # before the wait below, which would then wait for itself
    with _SWITCHING:  # which states a switch replaces or is refused by stays so until it has switched
        return _switch_roots(model, roots, adapters, options, background, started)


def _switch_roots(model, roots: dict, adapters, options: dict, background: bool, started: float) -> SwitchResult:
    state, replaced = state_for_switch(roots, options)
    specs = as_adapters(adapters)
    identity = combination_identity(specs, options["cache_root"], options["shards"])
    with state.gate.exclusive():
        held = is_merged(model) or state.pending is not None  # not taken off by lora_cache.unmerge since
        if state.handles and identity == state.identity and (held if specs else not is_merged(model)):
            return SwitchResult("unchanged", seconds=time.perf_counter() - started)
        planned = plan_targets(model, specs, options["shards"]) if specs else None  # bad input: fails, loses nothing
        if planned is not None:
            _check_values_first(planned[0])
        for old in replaced:
            _replace(old)
        if not state.handles:
            attach(state, _Enter(state), _Leave(state))
        _to_base(state)
        result = _switch(state, model, specs, planned, identity, background) if specs else SwitchResult("base")
        state.identity = identity
    result.seconds = time.perf_counter() - started
    return result


def _check_values_first(targets: list[LayerTarget]) -> None:
    """The adapters' values checked (NaN, inf) while the model still serves what it served:
    a refused adapter leaves it there, not at the base. Once per file in a process; a cached
    switch reads an adapter this once. A file planned from its conversion record has no
    values here: it is checked where a layer consumes them, as in a start."""
    try:
        check_before_use(d for t in targets for d in t.deltas)
    except ValuesNeeded:
        pass


def _switch(state: SwitchState, model, specs, planned, identity, background: bool) -> SwitchResult:
    """From the base to ``specs``: cached, else at run time and in the background, else now."""
    targets, files = planned
    if state.options["shards"] is not None:
        return _merge_parts(state, model, specs)
    kernels = plan_for_targets(targets, state.options["device"], kernel_roots(cache_roots(state.options["cache_root"])))
    split = RoundingSplit(targets, "runtime")  # what rounding would weaken stays at run time
    if _install_cached(state, identity, targets, files, specs, kernels, split):
        say(split.decided()[2])  # decided as a merge decides it: from the combination's record
        return SwitchResult("cached", layers=len(targets))
    merged, lossy, check = split.decided()
    unsupported = next((r for r in map(unsupported_reason, merged) if r is not None), None)
    if unsupported is not None or not background:  # merge's own rounding check says what it keeps
        with _combination_lock(identity):  # after a build of it still in flight (switched away and back)
            _merge_now(model, specs, state.options)
        return SwitchResult("built", layers=len(targets))
    say(check)
    copied = apply_runtime(targets)
    pending = Pending(identity, specs, files, merged, _stand_ins(merged), kernels, lossy)
    state.pending = pending
    _schedule(state, pending)
    return SwitchResult("runtime", layers=len(targets), runtime_bytes=runtime_bytes(targets), copied_bytes=copied)


def _merge_parts(state: SwitchState, model, specs) -> SwitchResult:
    """A tensor-parallel rank's switch: :func:`lora_cache.merge` of its parts, ``cached``
    when every layer was a hit, else ``built``."""
    stats = _merge_now(model, specs, state.options)
    return SwitchResult("cached" if stats.hit == stats.layers else "built", layers=stats.layers)


def _merge_now(model, specs, opts: dict):
    """:func:`lora_cache.merge` with the switch's options, undoable, raising where the cache
    cannot store a layer (a switch never leaves a layer merged in place)."""
    return merge(model, specs, cache_root=opts["cache_root"], max_size=opts["max_size"], base_files=opts["base_files"],
                 device=opts["device"], progress=False, fallback=False, unmergeable=True, shards=opts["shards"],
                 rank_timeout=opts["rank_timeout"])


def swap_ready(model, wait: bool = False, timeout: float | None = None) -> bool:
    """Swap in the merged layers of a combination built in the background, if they are ready.

    A safe point the server may offer between requests (the model's next forward call is
    one too). ``wait=True`` waits up to ``timeout`` seconds for the build first. Returns
    True when the model now serves merged weights (or the base), False while it still
    serves at run time. Re-raises the build's error, if it failed.
    """
    state = state_of(model)
    pending = state.pending
    if pending is None:
        return True
    if wait and pending.future is not None:
        try:
            pending.future.exception(timeout=timeout)
        except TimeoutError:
            return False
    if pending.error is not None:
        raise CacheBuildError(f"building the merged combination failed: {pending.error}") from pending.error
    return _swap(state, pending, blocking=True) or state.pending is None


def serving(model) -> str:
    """How ``model`` is served now: ``base``, ``runtime`` or ``merged``."""
    try:
        state = state_of(model)
    except ValueError:
        return "merged" if is_merged(model) else "base"
    if state.pending is not None:
        return "runtime"
    return "merged" if is_merged(model) else "base"


def build_reserve_bytes(model) -> int:
    """Host bytes a background build of ``model``'s pending combination may still need:
    one layer of output buffer and, for the layers that sum in fp32, one fp32 layer (the
    build's working set; 0 when nothing is being built). For the planner's budget."""
    try:
        pending = state_of(model).pending
    except ValueError:
        return 0
    if pending is None or pending.built:
        return 0
    sizes = [t.current.numel() for t in pending.targets if t.current.device.type == "cpu"]
    widest = max((t.current.numel() * t.current.element_size() for t in pending.targets), default=0)
    return widest + 4 * max(sizes, default=0)
