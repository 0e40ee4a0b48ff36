"""``execute(plan, components)``: run a deployment plan on loaded components.

A context manager. On entry it pins the plan's pinned layers in place, chooses the
faster reader for read-ahead, and hooks every planned layer (forward pre- and post-
hooks) and every component's own forward (to count passes). On a CUDA host the plan's
resident layers and each component's tensors outside its layers go to the device,
and moved layers are copied on a side stream (:mod:`.device_copy`); on a CPU host
layers compute where they lie and only read-ahead and release run. On exit every
hook, pin, device tensor, descriptor and thread it made is gone and the modules are
as they were. :meth:`Executor.stats` says what each pass read, released, copied and
waited, next to the plan's prediction.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Mapping

import torch

from hostmem.errors import InputError
from hostmem.pinning import Pinner

from ..deployment import DeploymentPlan
from .calibration import saved_reader
from .layout import MapIndex, layer_layout
from .pipeline import LayerPipeline
from .readahead import FileHandles, choose_reader, set_random
from .roles import ComponentRoles, plan_roles
from .stats import ExecutorStats, PassStats, read_io_bytes

__all__ = ["Executor", "execute"]


def _check_sizes(plan: DeploymentPlan, name: str, layouts) -> None:
    units = {u.name: u.nbytes for u in plan.components[name].units}
    for layer, layout in layouts.items():
        if units.get(layer) != layout.nbytes:
            raise InputError(
                f"{name}.{layer}: the plan has {units.get(layer)} bytes, the module {layout.nbytes}; the plan "
                "was made from other weights: plan again after loading (planners.startup.plan_loaded)"
            )


class Executor:
    """Runs ``plan`` on ``components``; see the module doc. Use :func:`execute`."""

    def __init__(self, plan: DeploymentPlan, components: Mapping[str, torch.nn.Module], *, prefetch: int | None = None,
                 device: str | torch.device | None = None, read_ahead: str = "auto",
                 disk_read: float | None = None, pinner: Pinner | None = None):
        prefetch = plan.pins.prefetch if prefetch is None else prefetch  # the plan's: its kept set is ours
        if prefetch < 0:
            raise InputError(f"prefetch {prefetch}: give 0 or more layers to read ahead")
        self.plan, self.components, self.prefetch = plan, dict(components), prefetch
        self.device = torch.device(device) if device is not None else None
        if self.device is not None and self.device.type == "cuda" and not torch.cuda.is_available():
            raise InputError(f"device {self.device}: this host has no CUDA device; leave device unset on a CPU host")
        self.read_ahead, self.disk_read, self._pinner = read_ahead, disk_read, pinner
        self.roles: dict[str, ComponentRoles] = {}
        self.pipelines: dict[str, LayerPipeline] = {}
        self._hooks: list = []
        self._placed: list = []  # (table, name, host tensor) put back on exit
        self._handles = FileHandles()
        self._random: list = []  # ranges advised MADV_RANDOM, set back on exit
        self._worker: ThreadPoolExecutor | None = None
        self._pass_start: dict[str, tuple[float, int]] = {}
        self._stats: ExecutorStats | None = None

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

    def _layouts(self, maps: MapIndex) -> dict[str, dict]:
        out = {}
        for name, roles in self.roles.items():
            if name not in self.components:
                raise InputError(f"the plan moves layers of {name!r}, but no module of that name was given; "
                                 f"pass {{'{name}': module}} with the others")
            hooked = roles.order if roles.moves else roles.resident
            out[name] = {layer: layer_layout(name, self.components[name], layer, maps) for layer in hooked}
            _check_sizes(self.plan, name, out[name])
        return out

    def _start(self) -> None:
        self.roles = plan_roles(self.plan, self.prefetch)
        layouts = self._layouts(MapIndex())
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
            moved = {k: v for k, v in layouts[name].items() if k not in roles.resident}
            pipe = LayerPipeline(roles, moved, self.prefetch, self._worker, self._handles, reader, copier)
            self.pipelines[name] = pipe
            self._hook(name, pipe)
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
        from .device_copy import DeviceCopier, slot_bytes

        moved = [slot_bytes(l) for n, r in self.roles.items() for k, l in layouts[n].items() if k not in r.resident]
        return DeviceCopier(self.device, self.prefetch + 1, max(moved)) if moved else None

    def _place_on_device(self, layouts) -> None:
        """Resident layers and each component's tensors outside its layers go to the device."""
        for name, roles in self.roles.items():
            root = self.components[name]
            inside = {id(m) for k, l in layouts[name].items() if k not in roles.resident for m in l.module.modules()}
            for module in root.modules():
                if id(module) in inside:
                    continue
                for table in (module._parameters, module._buffers):
                    for key, tensor in list(table.items()):
                        if tensor is None or tensor.device.type != "cpu":
                            continue
                        moved = tensor.detach().to(self.device)
                        self._placed.append((table, key, tensor))
                        table[key] = torch.nn.Parameter(moved, requires_grad=False) if table is module._parameters \
                            else moved

    # ------------------------------------------------------------------ hooks
    def _hook(self, name: str, pipe: LayerPipeline) -> None:
        root = self.components[name]
        self._hooks.append(root.register_forward_pre_hook(lambda m, a, n=name: self._pass_begin(n)))
        self._hooks.append(root.register_forward_hook(lambda m, a, o, n=name: self._pass_end(n)))
        for layer, layout in pipe.layouts.items():
            self._hooks.append(layout.module.register_forward_pre_hook(lambda m, a, l=layer: pipe.before(l)))
            self._hooks.append(layout.module.register_forward_hook(lambda m, a, o, l=layer: pipe.after(l)))

    def _pass_begin(self, name: str) -> None:
        index = sum(1 for p in self._stats.passes if p.component == name)
        roles = self.roles[name]
        predicted_s = roles.predicted_read_bytes / self.disk_read if self.disk_read else None
        self.pipelines[name].current = PassStats(name, index, predicted_read_bytes=roles.predicted_read_bytes,
                                                 predicted_s=predicted_s)
        self._pass_start[name] = (time.perf_counter(), read_io_bytes())

    def _pass_end(self, name: str) -> None:
        pipe = self.pipelines[name]
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

    def close(self) -> None:
        """Remove every hook; drain reads; put host tensors back; unpin; close files."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        for pipe in self.pipelines.values():
            pipe.drain()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        for ranges in self._random:
            set_random(ranges, False)
        self._random.clear()
        for table, key, tensor in reversed(self._placed):
            table[key] = tensor
        self._placed.clear()
        copiers = {id(p.copier): p.copier for p in self.pipelines.values() if p.copier is not None}
        for copier in copiers.values():
            copier.close()
        if self._pinner is not None:
            for key in [k for k in self._pinner.keys() if isinstance(k, tuple) and k[:1] == ("executor",)]:
                self._pinner.unpin(key)
        self._handles.close()


def execute(plan: DeploymentPlan, components: Mapping[str, torch.nn.Module], **options) -> Executor:
    """``with execute(plan, {"dit": transformer, ...}) as run: ...``; see :class:`Executor`.

    Options: ``prefetch`` (layers read ahead, at most: default the plan's, whose kept set the
    report states; the bytes read ahead are bounded too, see :mod:`.roles`), ``device`` (``"cuda:0"`` to copy
    moved layers to a GPU; unset on a CPU host; ``"cpu"`` runs the device path's twin,
    copies into a pool of CPU buffers, for tests), ``read_ahead`` (``auto``, ``fault``,
    ``madvise``, ``fadvise``, ``read`` or ``parallel``: see :mod:`.readahead`), ``disk_read`` (bytes/s, to
    predict each pass's read time), ``pinner`` (a :class:`hostmem.pinning.Pinner`).
    """
    return Executor(plan, components, **options)
