"""One component's layers in pass order: what to read ahead, when to wait, what to release.

When a layer enters the window its reads start (``advise``: the whole window is in the
disk's queue at once), and the worker thread waits for them (``read``: reads them; on a
CUDA host also copies) while the current one computes (on a CPU host an advised layer
is waited for at its own pre-hook, without a hand-off),
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
                 worker: ThreadPoolExecutor, handles: FileHandles, reader: str, copier=None):
        self.roles, self.layouts, self.prefetch = roles, layouts, prefetch
        self.worker, self.handles, self.reader, self.copier = worker, handles, reader, copier
        # On a CPU host with an advising reader the wait runs in this thread, at the layer's
        # pre-hook: no hand-off per layer, which on busy cores costs a time slice each.
        self.inline = copier is None and reader not in ("read", "fault")
        self.order = [name for name in roles.order if name in layouts]
        self.position = {name: i for i, name in enumerate(self.order)}
        self.released = set(roles.released)
        self.pinned = set(roles.pinned)
        self.unread = set(roles.kept) | self.released  # kept ones leave this set once read
        self.pending: dict[str, Future | None] = {}  # None: advised, waited for inline
        self.current: PassStats | None = None
        self._attached: dict[str, tuple] = {}

    def _needs_work(self, name: str) -> bool:
        if self.copier is not None:
            return True  # every moved layer is copied to the device on every pass
        return name in self.unread or name in self.released

    def _job(self, name: str):
        layout = self.layouts[name]
        nbytes = complete(layout.ranges, self.handles, self.reader) if name in self.unread else 0
        loaded = self.copier.load(layout, name in self.pinned) if self.copier is not None else None
        return nbytes, loaded

    def _schedule(self, name: str) -> None:
        if name in self.pending or not self._needs_work(name):
            return
        if name in self.unread:  # into the disk's queue now: every layer of the window at once
            advise(self.layouts[name].ranges, self.handles, self.reader)
        self.pending[name] = None if self.inline else self.worker.submit(self._job, name)

    def _look_ahead(self, name: str) -> None:
        """Schedule the next layers after ``name`` that need work (wrapping): up to ``prefetch``
        of them and the plan's read-ahead bytes (always the next one), the window it made room for."""
        at, n, count, ahead = self.position[name], len(self.order), 0, 0
        for step in range(1, n):
            if count >= self.prefetch:
                break
            upcoming = self.order[(at + step) % n]
            if self._needs_work(upcoming):
                ahead += self.layouts[upcoming].mapped_bytes
                if count and ahead > self.roles.read_ahead_bytes:
                    break
                self._schedule(upcoming)
                count += 1

    def before(self, name: str) -> None:
        """Forward pre-hook of layer ``name``: start the window, wait for this layer's bytes."""
        if name not in self.position:
            return
        self._schedule(name)
        self._look_ahead(name)
        future = self.pending.pop(name, None)
        began = time.perf_counter()
        if self.inline:  # the advice went out with the window; the wait is the touch, here
            nbytes = complete(self.layouts[name].ranges, self.handles, self.reader) if name in self.unread else 0
            loaded = None
        elif future is not None:
            nbytes, loaded = future.result()
        else:
            return
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
            freed = release(self.layouts[name].ranges, self.handles, back=True)
            if self.current is not None:
                self.current.released_bytes += freed

    def drain(self) -> None:
        """Wait for reads in flight and release what was read ahead for a pass that never came."""
        for name, future in list(self.pending.items()):
            try:
                if future is None:  # advised only: wait for the reads, or the release would miss pages in flight
                    complete(self.layouts[name].ranges, self.handles, self.reader)
                else:
                    future.result()
            except Exception:  # a read that failed has nothing to release; close goes on
                continue
            if name in self.released:
                release(self.layouts[name].ranges, self.handles)
        self.pending.clear()
