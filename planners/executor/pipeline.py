"""One component's layers in pass order: what to read ahead, when to wait, what to release.

When a layer enters the window an advisor thread starts its reads (``advise``), and the
worker thread waits for them (and on a CUDA host copies) while the current one computes,
for the next ``prefetch`` layers that need it: on a CPU host released layers every pass
and kept layers until they were read once; on a CUDA host every moved layer, every pass
(pinned ones copied straight from their pages, the others through staging). The window
wraps around the end of a pass, so the next pass's first layers are on their way
while the last ones compute. Pinned and kept layers are never released.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

from .layout import LayerLayout
from .readahead import FileHandles, advise, complete, release
from .roles import ComponentRoles
from .stats import PassStats

__all__ = ["LayerPipeline"]


class LayerPipeline:
    """The read-ahead, copy and release of one component's hooked layers."""

    def __init__(self, roles: ComponentRoles, layouts: dict[str, LayerLayout], prefetch: int,
                 worker: ThreadPoolExecutor, handles: FileHandles, reader: str, copier=None,
                 advisor: ThreadPoolExecutor | None = None):
        self.roles, self.layouts, self.prefetch = roles, layouts, prefetch
        self.worker, self.handles, self.reader, self.copier = worker, handles, reader, copier
        self.advisor = advisor  # starts reads (advice may block while the disk's queue is full)
        self.order = [name for name in roles.order if name in layouts]
        self.position = {name: i for i, name in enumerate(self.order)}
        self.released = set(roles.released)
        self.pinned = set(roles.pinned)
        self.unread = set(roles.kept) | self.released  # kept ones leave this set once read
        self.pending: dict[str, Future] = {}
        self.current: PassStats | None = None
        self._attached: dict[str, tuple] = {}

    def _needs_work(self, name: str) -> bool:
        if self.copier is not None:
            return True  # every moved layer is copied to the device on every pass
        return name in self.unread or name in self.released

    def _job(self, name: str, advised: Future | None = None):
        if advised is not None:
            advised.result()  # never after the release: a late advice would read the layer back in
        layout = self.layouts[name]
        nbytes = complete(layout.ranges, self.handles, self.reader) if name in self.unread else 0
        loaded = self.copier.load(layout, name in self.pinned) if self.copier is not None else None
        return nbytes, loaded

    def _schedule(self, name: str) -> None:
        if name not in self.pending and self._needs_work(name):
            advised = None
            if name in self.unread and self.advisor is not None:  # into the disk's queue now, off this thread
                advised = self.advisor.submit(advise, self.layouts[name].ranges, self.handles, self.reader)
            self.pending[name] = self.worker.submit(self._job, name, advised)

    def _look_ahead(self, name: str) -> None:
        """Schedule the next ``prefetch`` layers after ``name`` that need work (wrapping)."""
        at, n, count = self.position[name], len(self.order), 0
        for step in range(1, n):
            if count >= self.prefetch:
                break
            upcoming = self.order[(at + step) % n]
            if self._needs_work(upcoming):
                self._schedule(upcoming)
                count += 1

    def before(self, name: str) -> None:
        """Forward pre-hook of layer ``name``: start the window, wait for this layer's bytes."""
        if name not in self.position:
            return
        self._schedule(name)
        self._look_ahead(name)
        future = self.pending.pop(name, None)
        if future is None:
            return
        began = time.perf_counter()
        nbytes, loaded = future.result()
        waited = time.perf_counter() - began
        if name not in self.released:
            self.unread.discard(name)  # kept: read once, never again
        if loaded is not None:
            self._attached[name] = (loaded, self.copier.attach(loaded))
        if self.current is not None:
            self.current.wait_s += waited
            self.current.read_ahead_bytes += nbytes
            self.current.copied_bytes += loaded.nbytes if loaded is not None else 0

    def after(self, name: str) -> None:
        """Forward hook of layer ``name``: give the device buffer back, release a streamed layer."""
        if name in self._attached:
            loaded, saved = self._attached.pop(name)
            self.copier.detach(loaded, saved)
        if name in self.released:
            freed = release(self.layouts[name].ranges, self.handles)
            if self.current is not None:
                self.current.released_bytes += freed

    def drain(self) -> None:
        """Wait for reads in flight and release what was read ahead for a pass that never came."""
        for name, future in list(self.pending.items()):
            try:
                _, loaded = future.result()
            except Exception:  # a read that failed has nothing to release; close goes on
                continue
            if name in self.released:
                release(self.layouts[name].ranges, self.handles)
        self.pending.clear()
