"""``execute(plan, components)``: run a deployment plan on loaded components.

A context manager. On entry it pins the plan's pinned layers in place, chooses the
faster reader for read-ahead, and hooks every planned layer (forward pre- and post-
hooks) and every component's own forward (to count passes; on the device path it is
also wrapped, :mod:`.forward_guard`). On a CUDA host the plan's resident layers and
each component's tensors outside its layers go to the device, and moved layers are
copied on a side stream (:mod:`.device_copy`); on a CPU host
layers compute where they lie and only read-ahead and release run. On exit every
hook, pin, device tensor, descriptor and thread it made is gone and the modules are
as they were. :meth:`Executor.stats` says what each pass read, released, copied and
waited, next to the plan's prediction.
"""

from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Mapping

import torch

from hostmem.errors import InputError
from hostmem.forward_exit import is_wrapped
from hostmem.pinning import Pinner

from ..deployment import DeploymentPlan
from ..calibration import saved_reader
from ..named_components import named_components
from ..offload_hooks import refuse_offload_hooks
from .forward_guard import guard_forward, refuse_grad
from .layout import MapIndex, layer_module, tensor_span
from .pages import page_cover
from .pipeline import Clock, LayerPipeline
from .placing import bring_home, on_device, place_outside, put_back
from .readahead import FileHandles, choose_reader, set_random
from ..layer_roles import ComponentRoles, plan_roles
from .snapshot import take_snapshot
from .turns import Turn
from .stats import ExecutorStats, PassStats, read_io_bytes

__all__ = ["Executor", "execute"]


def _first_seen_bytes(root: torch.nn.Module, layers) -> dict[str, int]:
    """Each layer's host bytes as the plan counted them: a storage several tensors share once,
    under the first name it goes by (parameters, then buffers, in module order: the accountant's rule)."""
    prefixes = sorted(((layer + ".", layer) for layer in layers), key=lambda p: -len(p[0]))
    out, seen = dict.fromkeys(layers, 0), set()
    named = [(n, t) for kind in ("_parameters", "_buffers") for prefix, m in root.named_modules(remove_duplicate=False)
             for n, t in ((f"{prefix}.{k}" if prefix else k, t) for k, t in getattr(m, kind).items()) if t is not None]
    for name, tensor in named:
        if not tensor.is_cpu:
            continue
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key in seen:
            continue
        seen.add(key)
        owner = next((layer for prefix, layer in prefixes if name.startswith(prefix)), None)
        if owner is not None:
            out[owner] += storage.nbytes()
    return out


def _check_sizes(plan: DeploymentPlan, name: str, root: torch.nn.Module, layers) -> None:
    units = {u.name: u.nbytes for u in plan.components[name].units}
    for layer, nbytes in _first_seen_bytes(root, layers).items():
        if units.get(layer) != nbytes:
            raise InputError(
                f"{name}.{layer}: the plan has {units.get(layer)} bytes, the module {nbytes}; the plan "
                "was made from other weights: plan again after loading (planners.startup.plan_loaded)"
            )


# every module a live executor runs, and which: a second executor on any of them is refused
_RUNNING: "weakref.WeakKeyDictionary[torch.nn.Module, Executor]" = weakref.WeakKeyDictionary()
_RUNNING_LOCK = threading.Lock()


class Executor:
    """Runs ``plan`` on ``components``; see the module doc. Use :func:`execute`."""

    def __init__(self, plan: DeploymentPlan, components: Mapping[str, torch.nn.Module], *, prefetch: int | None = None,
                 device: str | torch.device | None = None, read_ahead: str = "auto",
                 disk_read: float | None = None, pinner: Pinner | None = None):
        prefetch = plan.pins.prefetch if prefetch is None else prefetch  # the plan's: its kept set is ours
        if prefetch < 0:
            raise InputError(f"prefetch {prefetch}: give 0 or more layers to read ahead")
        self.plan, self.prefetch = plan, prefetch
        self.components = named_components(plan.components, components, f"deployment {plan.deployment}", every=False)
        self.device = torch.device(device) if device is not None else None
        if self.device is not None and self.device.type == "cuda" and not torch.cuda.is_available():
            raise InputError(f"device {self.device}: this host has no CUDA device; leave device unset on a CPU host")
        self.read_ahead, self.disk_read, self._pinner = read_ahead, disk_read, pinner
        self.roles: dict[str, ComponentRoles] = {}
        self.pipelines: dict[str, LayerPipeline] = {}
        self._hooks: list = []
        self._placed: list = []  # (host tensor, placed, its state, [(table, name), ...]) put back on exit
        self._callers_on_device: dict = {}  # what the components held on the device before the run
        self._handles = FileHandles()
        self._random: list = []  # ranges advised MADV_RANDOM, set back on exit
        self._worker: ThreadPoolExecutor | None = None
        self._pass_start: dict[str, tuple[float, int]] = {}
        self._stats: ExecutorStats | None = None
        self._clock = Clock()
        self._claimed: list[torch.nn.Module] = []
        # on the device path, passes of one component from two threads take turns: a layer's
        # copy is attached to its module, which both would use (a second thread's pre-hook
        # gave the first's slot back while it computed from it)
        self._turns: dict[str, Turn] = {}
        self._forwards: list = []  # what sets each component's forward back (the device path wraps it)
        self._lefts: dict = {}  # what each wrapper runs when an interrupt leaves the forward
        self._closed = False  # a hook torch entered before close took it off does nothing after

    # ------------------------------------------------------------------ entry
    def __enter__(self) -> "Executor":
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _snapshots(self, maps: MapIndex) -> dict[str, dict]:
        out = {}
        for name, roles in self.roles.items():
            if name not in self.components:
                raise InputError(f"the plan moves layers of {name!r}, but no module of that name was given; "
                                 f"pass {{'{name}': module}} with the others (or a pipeline holding it by that name)")
            hooked = roles.order if roles.moves else roles.resident
            root = self.components[name]
            for layer in hooked:
                layer_module(name, root, layer)  # a clear error for a layer the module lacks
            _check_sizes(self.plan, name, root, hooked)
            out[name] = {layer: take_snapshot(name, root, layer, maps) for layer in hooked}
        return out

    def _rest_cover(self, name: str, snapshots: dict, maps: MapIndex) -> list:
        """Pages of the component's tensors outside every hooked layer: never released."""
        inside = {id(m) for snap in snapshots.values() for m in snap.layout.module.modules()}
        ranges = []
        for module in self.components[name].modules():
            if id(module) in inside:
                continue
            for tensor in [*module._parameters.values(), *module._buffers.values()]:
                if tensor is not None and tensor.is_cpu and tensor.numel():
                    found = maps.find(*tensor_span(tensor))
                    ranges += [found] if found is not None else []
        return page_cover(ranges)

    def _claim(self) -> None:
        """Every module of the components is this executor's until it closes. Two executors on
        one module would hook its layers twice, and the second's device copies would stand in
        for the first's (wrong outputs, and weights left on freed buffers at exit): refused."""
        modules = [m for root in self.components.values() for m in root.modules()]
        with _RUNNING_LOCK:
            for name, root in self.components.items():
                busy = next((m for m in root.modules() if _RUNNING.get(m, self) is not self), None)
                if busy is not None:
                    raise InputError(f"{name!r}: its {type(busy).__name__} is already run by another executor "
                                     "(a `with execute(...)` block not left yet); leave that one first")
            for module in modules:
                _RUNNING[module] = self
            self._claimed = modules

    def _start(self) -> None:
        self._claim()
        refuse_offload_hooks(self.components)
        self.roles = plan_roles(self.plan, self.prefetch)
        maps = MapIndex()
        snapshots = self._snapshots(maps)
        layouts = {n: {k: snap.layout for k, snap in s.items()} for n, s in snapshots.items()}
        copies = self.device is not None  # a device, or "cpu": the device path's twin (tests)
        self._pin(layouts)
        for name, roles in self.roles.items():
            for layer in roles.kept + roles.released:
                set_random(layouts[name][layer].ranges, True)
                self._random.append(layouts[name][layer].ranges)
        reader = choose_reader(self.read_ahead, saved_reader())  # decided once per machine: calibrate's record
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hostmem-readahead")
        copier = self._copier(layouts) if copies else None
        if copies:
            self._place_on_device(layouts)
        for name, roles in self.roles.items():
            moved = {k: v for k, v in snapshots[name].items() if k not in roles.resident}
            pipe = LayerPipeline(roles, moved, self.prefetch, self._worker, self._handles, reader, copier,
                                 root=self.components[name], rest_cover=self._rest_cover(name, moved, maps),
                                 clock=self._clock)
            self.pipelines[name] = pipe
            self._hook(name, pipe)
        for pipe in self.pipelines.values():
            pipe.neighbours = list(self.pipelines.values())
        self._stats = ExecutorStats(
            reader=reader, device=str(self.device or "cpu"),
            roles={n: {k: len(getattr(r, k)) for k in ("resident", "pinned", "kept", "released")}
                   for n, r in self.roles.items()},
            kept_bytes={n: r.kept_bytes for n, r in self.roles.items()},
            predicted_read_bytes={n: r.predicted_read_bytes for n, r in self.roles.items()},
            pinned_bytes=self._pinner.locked_bytes if self._pinner is not None else 0,
        )

    def _pin(self, layouts) -> None:
        wanted = [(n, l) for n, r in self.roles.items() for l in r.pinned if l in layouts[n]]
        if not wanted:
            return
        self._pinner = self._pinner if self._pinner is not None else Pinner()
        for name, layer in wanted:
            self._pinner.pin(("executor", name, layer), layouts[name][layer].tensors)

    def _copier(self, layouts):
        from .device_copy import DeviceCopier, alignment, slot_bytes

        align = alignment(self.device)
        moved = [slot_bytes(l, align) for n, r in self.roles.items() for k, l in layouts[n].items() if k not in r.resident]
        return DeviceCopier(self.device, self.prefetch + 1, max(moved)) if moved else None

    def _place_on_device(self, layouts) -> None:
        """Resident layers and each component's tensors outside its layers go to the device
        (:func:`.placing.place_outside`)."""
        self._callers_on_device = on_device(self.components, self.device)
        self._placed += place_outside(self.components, self.roles, layouts, self.device)

    # ------------------------------------------------------------------ hooks
    def _hook(self, name: str, pipe: LayerPipeline) -> None:
        root = self.components[name]
        self._hooks.append(root.register_forward_pre_hook(lambda m, a, n=name: self._pass_begin(n)))
        # always_call: a forward that raises still ends its pass and gives its layer's buffer back
        self._hooks.append(root.register_forward_hook(lambda m, a, o, n=name: self._pass_end(n), always_call=True))
        hooked = set()
        for layer, layout in pipe.layouts.items():
            if id(layout.module) in hooked:  # one module under two layer names: its first name
                continue
            hooked.add(id(layout.module))
            self._hooks.append(layout.module.register_forward_pre_hook(
                lambda m, a, k, l=layer: self._layer_begin(name, l, m, a, k), with_kwargs=True))
            self._hooks.append(layout.module.register_forward_hook(lambda m, a, o, l=layer: self._layer_end(pipe, l),
                                                                   always_call=True))
        if self.device is not None:
            self._lefts[name] = lambda n=name: self._interrupted(n)
            self._forwards.append(guard_forward(root, self._lefts[name]))

    def _layer_begin(self, name: str, layer: str, module: torch.nn.Module, args, kwargs) -> None:
        if self._closed:
            return
        if self.device is not None:  # the device path serves inference (see .forward_guard)
            refuse_grad(name, layer, args, kwargs)
        self.pipelines[name].before(layer)

    def _layer_end(self, pipe: LayerPipeline, layer: str) -> None:
        if not self._closed:
            pipe.after(layer)

    def _interrupted(self, name: str) -> None:
        """The component's forward was left by a ``KeyboardInterrupt`` (see :mod:`.forward_guard`)."""
        self.pipelines[name].interrupted()
        self._pass_end(name)

    def _boundary(self) -> None:
        """A pass begins or ends: no device copy made before it serves a layer after it."""
        self._clock.value += 1
        for pipe in self.pipelines.values():
            pipe.boundary()

    def _pass_begin(self, name: str) -> None:
        if self._closed:  # a call that began as the executor closed: it runs on the weights put back
            return
        if self.device is not None:  # the device path: one pass of a component at a time (see _turns)
            root = self.components[name]
            if not is_wrapped(root, self._lefts[name]):  # another library's hook, taken off since, dropped it
                self._forwards.append(guard_forward(root, self._lefts[name]))
            turn = self._turns.setdefault(name, Turn(root))
            if turn.take():  # from a pass an interrupt left unseen
                self.pipelines[name].interrupted()
                self._end_pass(name)
            if self._closed:  # the exit had the turn meanwhile: this call runs on the weights put back
                turn.give_back()
                return
        self._boundary()
        index = sum(1 for p in self._stats.passes if p.component == name)
        roles = self.roles[name]
        predicted_s = roles.predicted_read_bytes / self.disk_read if self.disk_read else None
        self.pipelines[name].current = PassStats(name, index, predicted_read_bytes=roles.predicted_read_bytes,
                                                 predicted_s=predicted_s)
        self._pass_start[name] = (time.perf_counter(), read_io_bytes())
        self.pipelines[name].begin()

    def _pass_end(self, name: str) -> None:
        if self._closed:
            return
        try:
            self._end_pass(name)
        finally:
            turn = self._turns.get(name)
            if turn is not None:
                turn.give_back()

    def _end_pass(self, name: str) -> None:
        pipe = self.pipelines[name]
        pipe.end()
        self._boundary()
        current, pipe.current = pipe.current, None
        if current is None or name not in self._pass_start:
            return
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        began, read = self._pass_start.pop(name)
        current.seconds = time.perf_counter() - began
        current.read_bytes = read_io_bytes() - read
        self._stats.passes.append(current)

    # ------------------------------------------------------------------ exit
    def stats(self) -> ExecutorStats:
        """What was measured so far (a live object: later passes are appended)."""
        if self._stats is None:
            raise RuntimeError("the executor has not started: use it as `with execute(plan, components) as ex:`")
        return self._stats

    def settle(self) -> None:
        """Return once every read-ahead and copy in flight has ended (a fence for tests and benchmarks:
        what is done next, such as a weight written in place, cannot race a copy of it)."""
        if self._worker is not None:
            self._worker.submit(int).result()  # one worker thread: every job before this one is done

    def close(self) -> None:
        """Remove every hook; drain reads; put host tensors back; unpin; close files. Each step
        runs even where one before it failed (the first error is raised after all of them)."""
        held = self._hold_turns()
        try:
            self._close()
        finally:
            for turn in held:
                turn.give_back()

    def _hold_turns(self) -> list[Turn]:
        """On the device path, every component's turn: a pass another thread has under way ends
        before its layers' copies and slots are taken down (it raised, or computed from freed
        slots); then no hook does anything any more."""
        held = []
        if self.device is not None and not self._closed:
            for name in self.pipelines:
                turn = self._turns.setdefault(name, Turn(self.components[name]))
                if turn.take(outside=True):  # from a pass an interrupt left unseen
                    self.pipelines[name].interrupted()
                    self._end_pass(name)
                held.append(turn)
        self._closed = True
        return held

    def _close(self) -> None:
        failed: list[BaseException] = []

        def step(fn, *args) -> None:
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 (raised after the other steps)
                failed.append(exc)

        for handle in self._hooks:
            step(handle.remove)
        self._hooks.clear()
        for undo in self._forwards:
            step(undo)
        self._forwards.clear()
        self._lefts.clear()
        for pipe in self.pipelines.values():
            step(pipe.drain)
        if self._worker is not None:
            step(self._worker.shutdown, True)
            self._worker = None
        for ranges in self._random:
            step(set_random, ranges, False)
        self._random.clear()
        step(self._put_back)
        copiers = {id(p.copier): p.copier for p in self.pipelines.values() if p.copier is not None}
        for copier in copiers.values():
            step(copier.close)
        if self._pinner is not None:
            for key in [k for k in self._pinner.keys() if isinstance(k, tuple) and k[:1] == ("executor",)]:
                step(self._pinner.unpin, key)
        step(self._handles.close)
        self.pipelines.clear()  # their snapshots hold the layers' last tensors: a kept `run` keeps no mapping
        with _RUNNING_LOCK:
            for module in self._claimed:
                if _RUNNING.get(module) is self:
                    del _RUNNING[module]
            self._claimed = []
        if failed:
            raise failed[0]

    def _put_back(self) -> None:
        """The host tensors back where the device's stood (:func:`.placing.put_back`)."""
        put_back(self._placed)
        if self._placed:
            bring_home(self.components, self.device, self._callers_on_device)
        self._placed.clear()
        self._callers_on_device = {}


def execute(plan: DeploymentPlan, components: Mapping[str, torch.nn.Module], **options) -> Executor:
    """``with execute(plan, {"dit": transformer, ...}) as run: ...``; see :class:`Executor`.
    ``components`` may be a diffusers pipeline too (its component of each planned name, a
    ``dit`` its ``transformer`` or ``unet``), as :func:`planners.start` takes one.

    Options: ``prefetch`` (layers read ahead, at most: default the plan's, whose kept set the
    report states; the bytes read ahead are bounded too, see :mod:`.roles`), ``device`` (``"cuda:0"`` to copy
    moved layers to a GPU; unset on a CPU host; ``"cpu"`` runs the device path's twin,
    copies into a pool of CPU buffers, for tests), ``read_ahead`` (``auto``, ``fault``,
    ``madvise``, ``fadvise``, ``read`` or ``parallel``: see :mod:`.readahead`), ``disk_read`` (bytes/s, to
    predict each pass's read time), ``pinner`` (a :class:`hostmem.pinning.Pinner`).
    """
    return Executor(plan, components, **options)
