"""One component's layers, in whatever order they run: what to read ahead, when to wait, what to release.

When a layer runs (its forward pre-hook), the next ``prefetch`` layers that need work,
in the order the model was last seen to run them (:mod:`.order`), enter the window:
their reads start (``advise``: the whole window in the disk's queue at once), and the
worker thread waits for them (``read``; on a device also copies into a slot of
:mod:`.device_copy`) while this one computes (on a CPU host an advised layer is waited
for at its own pre-hook, without a hand-off). Work: on a CPU host, released layers
every time and kept layers until read once; on a device, every moved layer every time.

Read-ahead is a hint, never a promise of order (:mod:`.snapshot`). At use:

- the layer's tensors are fingerprinted; if they changed (a merge, a switch, a remap)
  the layer gets a new layout, and whatever was read ahead from the old one is dropped;
- a device copy read ahead is used only if it was made in this pass (the component's
  forward: an in-place write through ``.data`` between passes, as peft's merge does,
  changes no fingerprint, so no copy outlives the pass it was made in) from the tensors
  the module holds now; otherwise it is dropped and the layer is copied now. So the
  window's layers past the end of the pass (as last seen) are only read, and copied when
  the next pass begins;
- a layer read ahead that leaves the window without running is dropped: its slot given
  back, the reads the reader threads have not begun left undone (a step cache that skips
  the blocks after the first makes this the common case), and, when released, the pages
  it read released.

A release drops only the layer's own pages that no other layer needs (:mod:`.pages`):
not those of a kept, pinned or resident layer, of the tensors outside every layer, or
of a layer in the window. Pinned and kept layers are never released.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

from .order import LearnedOrder
from .pages import Intervals, ReleasesInFlight, free_pieces, page_cover, released_bytes
from .readahead import FileHandles, advise, cancel, complete, drop_range, read_ahead, uncache_ranges
from ..layer_roles import ComponentRoles
from .snapshot import Snapshot, fingerprint, take_snapshot
from .stats import PassStats

__all__ = ["Clock", "LayerPipeline"]

_LOG = logging.getLogger("hostmem")


class Clock:
    """Counts pass boundaries (any component's forward beginning or ending), shared by all
    pipelines; its lock makes their hooks take turns (two threads running passes on one model:
    what one hook reads ahead, drops or releases, the other sees whole)."""

    def __init__(self):
        self.value = 0
        self.lock = threading.RLock()


def _in_turn(hook):
    """A hook of the pipeline, run while no other pipeline hook runs (see :class:`Clock`), and
    not at all once the pipeline is drained (a pass on another thread that waited for its turn
    while the executor closed: its worker and files are gone, its weights put back)."""

    @functools.wraps(hook)
    def taking_turns(self, *args):
        with self.clock.lock:
            return None if self.drained else hook(self, *args)

    return taking_turns


class _Pending(NamedTuple):
    snapshot: Snapshot
    future: Future | None  # None: advised only, waited for inline
    slot: int | None  # the device slot the load owns
    epoch: int
    reads: bool  # the job reads the layer's pages
    copies: bool  # the job copies the layer to the device (else it only reads: the next pass's layers)


class LayerPipeline:
    """The read-ahead, copy and release of one component's hooked layers."""

    def __init__(self, roles: ComponentRoles, snapshots: dict[str, Snapshot], prefetch: int,
                 worker: ThreadPoolExecutor, handles: FileHandles, reader: str, copier=None, *,
                 root=None, rest_cover=(), clock: Clock | None = None):
        self.roles, self.snapshots, self.prefetch = roles, snapshots, prefetch
        self.worker, self.handles, self.reader, self.copier = worker, handles, reader, copier
        self.root, self.rest_cover, self.clock = root, list(rest_cover), clock or Clock()
        # On a CPU host with an advising reader the wait runs in this thread, at the layer's
        # pre-hook: no hand-off per layer, which on busy cores costs a time slice each.
        self.inline = copier is None and reader not in ("read", "fault")
        self.order = LearnedOrder([name for name in roles.order if name in snapshots])
        self.released = set(roles.released)
        self.pinned = set(roles.pinned)  # pages locked in place: copied without staging
        self.unread = set(roles.kept) | self.released  # kept ones leave this set once read
        self.pending: dict[str, _Pending] = {}
        self.neighbours: list[LayerPipeline] = [self]  # every pipeline sharing the copier's slots
        self.current: PassStats | None = None
        self._attached: dict[str, tuple] = {}
        self._warned = False  # a read-ahead that failed was logged
        self._release_warned = False  # a release that failed was logged
        self.releasing = ReleasesInFlight()  # releases on the worker thread (see _release)
        self._failed_releases: list[int] = []  # bytes of releases that failed on the worker, not yet counted
        self.drained = False  # the executor closed: no hook does anything any more
        self._protect()

    @property
    def layouts(self) -> dict:
        return {name: snap.layout for name, snap in self.snapshots.items()}

    def _protect(self) -> None:
        """The pages a release must never drop: every layer's that is not released, and the rest's."""
        kept = [r for name, snap in self.snapshots.items() if name not in self.released for r in snap.ranges]
        pinned = [r for name, snap in self.snapshots.items() if name in self.roles.pinned for r in snap.ranges]
        self.protected = Intervals(page_cover(kept) + self.rest_cover)
        self.never = Intervals(page_cover(pinned) + self.rest_cover)  # not even a straddling folio's part

    def _needs_work(self, name: str) -> bool:
        if self.copier is not None:
            return True  # every moved layer is copied to the device on every pass
        return name in self.unread or name in self.released

    # ------------------------------------------------------------------ what the layer holds now
    def _now(self, name: str) -> Snapshot:
        """The layer's snapshot, taken again when its tensors changed since (see :mod:`.snapshot`)."""
        snap = self.snapshots[name]
        if fingerprint(snap.layout.module) == snap.fingerprint:
            return snap
        snap = self.snapshots[name] = take_snapshot(snap.layout.component, self.root, name)
        self.pinned.discard(name)  # the new tensors' pages are not the ones locked
        if name in self.released or name in self.roles.kept:
            self.unread.add(name)  # new bytes: read once more
        if name not in self.released:
            self._protect()
        return snap

    # ------------------------------------------------------------------ the window
    def _job(self, snap: Snapshot, reads: bool, slot: int | None, pinned: bool, copies: bool):
        nbytes = complete(snap.ranges, self.handles, self.reader) if reads else 0
        loaded = self.copier.load(snap.layout, pinned, slot) if copies else None
        return nbytes, loaded

    def _schedule(self, name: str, copies: bool = True) -> None:
        """Start reading ``name`` ahead and, with ``copies`` on a device, copying it into a slot."""
        copies = copies and self.copier is not None
        held = self.pending.get(name)
        if held is not None and copies and not held.copies and held.snapshot is self.snapshots[name]:
            self._settle(self.pending.pop(name))  # read ahead for this pass: now copy it too
        elif held is not None or name in self._attached or not self._needs_work(name):
            return
        snap = self._now(name)
        slot = self.copier.acquire() if copies else None
        copies = copies and slot is not None  # every slot taken: read it now, copy it when it runs
        reads = name in self.unread
        if reads:  # into the disk's queue now: every layer of the window at once
            self.releasing.wait_for(snap.ranges)
            advise(snap.ranges, self.handles, self.reader)
        if not reads and not copies:
            return
        future = None if self.inline else self.worker.submit(self._job, snap, reads, slot, name in self.pinned, copies)
        self.pending[name] = _Pending(snap, future, slot, self.clock.value, reads, copies)

    def _settle(self, pending: _Pending) -> int:
        """Wait for a read-ahead that stands (its pages are used next); the bytes it read."""
        try:
            got = self._wait(pending)
        except Exception:  # noqa: BLE001 - a read that failed is read again at use
            return 0
        if got is not None and got[1] is not None:
            self.copier.give_back(got[1].slot)
        return got[0] if got is not None else 0

    def _drop(self, name: str, pending: _Pending) -> None:
        """Forget a read-ahead: give its slot back, release what it read for a released layer."""
        future = pending.future
        if future is not None and not future.cancel():
            try:
                future.result()  # a copy into the slot must end before another load takes it
            except Exception:  # noqa: BLE001 - a failed read-ahead has nothing to give back
                pass
        if self.copier is not None:
            self.copier.give_back(pending.slot)
        if future is None and pending.reads:
            cancel(pending.snapshot.ranges, self.handles)  # what the reader threads have not begun stays unread
        ran = future is None or not future.cancelled()
        if ran and pending.reads and name in self.released:
            self._release(pending.snapshot)

    def _window(self, name: str) -> None:
        """Schedule the layers that follow ``name``; drop read-aheads that left the window."""
        wanted, in_pass = self.order.ahead(name, self._needs_work, self.prefetch, size=self._mapped_bytes,
                                           budget=self.roles.read_ahead_bytes)
        for other in [n for n in self.pending if n not in wanted]:
            self._drop(other, self.pending.pop(other))
        for i, upcoming in enumerate(wanted):  # past the end of the pass: read only (see the module doc)
            self._schedule(upcoming, copies=i < in_pass)

    def _mapped_bytes(self, name: str) -> int:
        """The file bytes a read-ahead of ``name`` brings in (what the plan's window counts)."""
        return sum(r.length for r in self.snapshots[name].ranges)

    def _slot(self) -> int | None:
        """A free slot, dropping another pipeline's read-ahead when all are taken (nested components)."""
        slot = self.copier.acquire()
        for pipe in self.neighbours:
            if slot is not None:
                break
            for other in list(pipe.pending):
                pipe._drop(other, pipe.pending.pop(other))
                slot = self.copier.acquire()
                if slot is not None:
                    break
        return slot

    # ------------------------------------------------------------------ hooks
    @_in_turn
    def begin(self) -> None:
        """The component's forward begins: its first layers, as last seen, enter the window."""
        self.order.begin_pass()
        first, _ = self.order.ahead(self.order.first, self._needs_work, self.prefetch, include=True,
                                    size=self._mapped_bytes, budget=self.roles.read_ahead_bytes)
        for name in first:
            self._schedule(name)

    @_in_turn
    def end(self) -> None:
        """The component's forward ends: the last layer it ran ends a pass."""
        self.order.end_pass()
        self._count_failed_releases()

    @_in_turn
    def boundary(self) -> None:
        """A pass began or ended (any component): no device copy made before it is used after it."""
        for name in [n for n, p in self.pending.items() if p.copies]:
            self._drop(name, self.pending.pop(name))

    def _fresh(self, pending: _Pending | None, snap: Snapshot) -> bool:
        """Whether a read-ahead was made from ``snap`` (and, for a device copy, in this pass)."""
        if pending is None or pending.snapshot is not snap:
            return False
        return self.copier is None or (pending.copies and pending.epoch == self.clock.value)

    def _wait(self, pending: _Pending):
        """``(bytes read, loaded)`` of a fresh read-ahead, or None when its copy is not of the tensors now."""
        if pending.future is None:
            return (complete(pending.snapshot.ranges, self.handles, self.reader) if pending.reads else 0), None
        try:
            nbytes, loaded = pending.future.result()
        except Exception as exc:  # noqa: BLE001 - read and copied now, in the caller
            self._failed(pending, exc)
            return None
        if loaded is not None and loaded.fingerprint != pending.snapshot.fingerprint:
            self.copier.give_back(loaded.slot)
            return None
        return nbytes, loaded

    def _failed(self, pending: _Pending, exc: Exception) -> None:
        """A read-ahead raised (the module changed under the worker, or a copy it cannot make): the
        layer is read now. Counted in the pass's ``failed_read_aheads``; the first is logged as a
        warning, since one that fails on every layer leaves the compute waiting on every read."""
        if self.current is not None:
            self.current.failed_read_aheads += 1
        if not self._warned:
            self._warned = True
            _LOG.warning("%s: a read-ahead of %s failed (%s: %s); the layer was read at its forward, and "
                         "stats().passes counts such failures in failed_read_aheads", pending.snapshot.layout.component,
                         pending.snapshot.layout.name, type(exc).__name__, exc)

    @_in_turn
    def interrupted(self) -> None:
        """The component's forward was left by an exception its hooks did not see (a
        ``KeyboardInterrupt``): every layer still attached gets its host tensors back."""
        for name in list(self._attached):
            self._detach(name)

    def _now_read(self, name: str, snap: Snapshot, slot: int | None, read: int | None = None):
        """Read (and copy) the layer here, in the caller: it was not read ahead, or not from what it
        holds (``read``: the bytes a read-ahead that stands brought in: not read again)."""
        if self.copier is not None and slot is None:
            slot = self._slot()
        if read is not None:
            nbytes = read
        elif name in self.unread:
            self.releasing.wait_for(snap.ranges)
            nbytes = read_ahead(snap.ranges, self.handles, self.reader)
        else:
            nbytes = 0
        loaded = self.copier.load(snap.layout, name in self.pinned, slot) if self.copier is not None else None
        return nbytes, loaded

    @_in_turn
    def before(self, name: str) -> None:
        """Forward pre-hook of layer ``name``: move the window on, wait for (or make) this layer's bytes."""
        if name not in self.snapshots:
            return
        if name in self._attached:
            self._detach(name)
        began = time.perf_counter()
        snap = self._now(name)
        self.order.seen(name)
        pending, slot, read = self.pending.pop(name, None), None, None
        if not self._fresh(pending, snap):
            if pending is not None and pending.snapshot is snap and not pending.copies:
                read = self._settle(pending)  # read ahead (the pass before): the pages stand, copy now
            elif pending is not None:
                self._drop(name, pending)
            pending = None
            slot = self._slot() if self.copier is not None else None  # before the window takes them all
        self._window(name)
        got = self._wait(pending) if pending is not None else None
        late = got is None and self._needs_work(name)
        if got is None:
            got = self._now_read(name, snap, slot, read)
        elif slot is not None:
            self.copier.give_back(slot)
        nbytes, loaded = got
        if name not in self.released:
            self.unread.discard(name)  # kept: read once, never again
        if loaded is not None:
            self._attached[name] = (loaded, self.copier.attach(loaded))
        if self.current is not None:
            self.current.wait_s += time.perf_counter() - began
            self.current.late_layers += late
            self.current.read_ahead_bytes += nbytes
            self.current.copied_bytes += loaded.nbytes if loaded is not None else 0

    def _detach(self, name: str) -> None:
        loaded, saved = self._attached.pop(name)
        self.copier.detach(loaded, saved)
        self.copier.give_back(loaded.slot)

    def _release(self, snap: Snapshot) -> int:
        """Release the snapshot's pages that no other layer needs; the bytes released.

        Which pages is decided here, against the window now. On a CPU host, part of the
        release runs on the worker thread, which an advising reader leaves idle (the
        system calls cost the pass's own thread 0.2-0.3 ms a 32 MiB layer): a shared
        mapping's whole release (a read-only mapping loses nothing to ``MADV_DONTNEED``),
        a private one's page-cache half only. A private mapping's pages are unmapped
        here, right after the layer's forward: its pagemap lookup and its release must
        see the same pages (see :mod:`.readahead`). A layer read again first waits for
        the release of its pages (:class:`.pages.ReleasesInFlight`).
        """
        needed = [p.snapshot for p in self.pending.values()]
        running = self.snapshots.get(self.order.last)
        if running is not None and running is not snap:
            needed.append(running)  # the layer computing now
        window = Intervals(page_cover([r for s in needed for r in s.ranges]))
        pieces = free_pieces(snap.ranges, snap.floors, [self.protected, window], [self.never, window])
        if not self.inline or not pieces:
            return self._drop_pieces(pieces)
        if any(r.private for r in snap.ranges):
            uncache: list = []
            freed = sum(drop_range(piece, self.handles, back=back, uncache=uncache) for piece, back in pieces)
            job = functools.partial(uncache_ranges, uncache)
        else:
            freed = released_bytes(pieces)
            job = functools.partial(self._drop_pieces, pieces)
        self.releasing.add(pieces, self.worker.submit(self._on_worker, job, snap, freed))
        return freed

    def _drop_pieces(self, pieces) -> int:
        return sum(drop_range(piece, self.handles, back=back) for piece, back in pieces)

    def _on_worker(self, job, snap: Snapshot, nbytes: int) -> None:
        """Run a release's part on the worker (``snap`` holds the mapping under it until then).
        A failure cannot raise in the forward that asked for it (that has run on): it is logged
        once, and counted by the pass's next hook (``failed_releases``, its ``nbytes`` taken back
        from ``released_bytes``); the pages stay, for the page cache to reclaim."""
        try:
            job()
        except OSError as exc:
            self._failed_releases.append(nbytes)
            if not self._release_warned:
                self._release_warned = True
                _LOG.warning("%s: a release on the executor's worker failed (%s); its pages were left to the "
                             "page cache, and stats().passes counts such failures in failed_releases",
                             snap.layout.component, exc)

    def _count_failed_releases(self) -> None:
        """Fold the releases that failed on the worker into the pass now running (this thread's
        figures only, so no two threads add to one field)."""
        while self._failed_releases:
            nbytes = self._failed_releases.pop()
            if self.current is not None:
                self.current.released_bytes -= nbytes
                self.current.failed_releases += 1

    @_in_turn
    def after(self, name: str) -> None:
        """Forward hook of layer ``name``: give the device buffer back, release a streamed layer."""
        if name in self._attached:
            self._detach(name)
        if name in self.released and name in self.snapshots:
            freed = self._release(self.snapshots[name])
            if self.current is not None:
                self.current.released_bytes += freed
        self._count_failed_releases()

    @_in_turn
    def drain(self) -> None:
        """Wait for reads in flight and release what was read ahead for a pass that never came."""
        for name in list(self._attached):
            self._detach(name)
        for name, pending in list(self.pending.items()):
            if pending.future is None and pending.reads:  # advised: wait, or the release misses pages in flight
                try:
                    complete(pending.snapshot.ranges, self.handles, self.reader)
                except Exception:  # noqa: BLE001 - a read that failed has nothing to release; close goes on
                    continue
            self._drop(name, self.pending.pop(name))
        self.pending.clear()
        self.drained = True
