"""Sessions: one open combination of the vault, its gets and puts, and its seal.

The store's contract is in the package docstring (:mod:`hostmem.vault`).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import torch

from hostmem.safetensors.mapping import SafetensorsError

from .behind import Parked, seal_behind
from .claims import unclaim_in_process
from .handoff import Handoff
from .adoption import drop_folder, shape_dtype_problem
from .durable import remove_tree
from .layer_file import LayerEntry, UnsealedLayer, discard_layer, layer_file_bytes, seal_layer, write_layer_data
from .leases import map_layer, map_recorded, remove_use_file_if_unused
from .piece_writer import PieceWriter
from .provisional import is_provisional
from .locks import say
from .read_ahead import ReadAhead
from .manifest import Manifest, touch_use_time, write_manifest
from .safety import VaultError
from .space import full_disk_advice, still_needed
from .verification import VerifiedMemo, record_damage

__all__ = ["VaultSession", "say"]


def _new_stats(waited: float, evicted) -> dict:
    counts = "layers_hit layers_missed layers_written layers_failed layers_resumed bytes_hit bytes_written".split()
    return {**dict.fromkeys(counts, 0), "seconds": 0.0, "rate": 0.0, "lock_wait_seconds": waited,
            "evicted": [c.key for c in evicted], "evicted_bytes": sum(c.bytes for c in evicted), "needed_bytes": 0,
            "available_bytes": 0, "dropped": None, "read_ahead_bytes": 0, "sealed_behind": False}


class VaultSession:
    """One open combination: get/put layers while holding its lock; close seals it.

    ``stats`` is live: layers hit, missed, written, failed, resumed; bytes hit and
    written; seconds spent writing and the rate; lock wait; evictions; the space
    needed and available; why the combination was dropped, if it was. When a put
    answers None, ``last_error`` is the one line to warn with and ``space`` (a
    :class:`SpaceCheck`) holds the numbers.
    """

    def __init__(self, vault, key, folder, locks, inputs, adopted, expected, waited, evicted):
        self.vault, self.key, self.folder = vault, key, folder
        self._lock, self._lease = locks
        self._entries: dict[str, LayerEntry] = adopted.entries
        manifest: Manifest | None = adopted.manifest
        self._inputs = inputs or (manifest.inputs if manifest else {})
        self._created = manifest.created if manifest else time.time()
        self._was_complete = bool(manifest and manifest.complete)
        self._sealed = dict(manifest.layers) if adopted.vouched else None  # what the seal would write again
        self._expected = expected
        self._closed = False
        self.after_seal = None  # called with the session after its seal, its lock still held (a re-key)
        self._map_problem = ""
        self._state = threading.Lock()  # a put's data and the seal of the put before it may run at once
        self._write_seconds: dict[str, float] = {}  # put_data's time, until its seal_put records it
        self._seal_failed = False  # a failed seal fails the seals after it (a failed put_data, the puts after it)
        self._writer: PieceWriter | None = None  # the streamed puts' pieces, on their way across layers
        self._pieces: dict = {}  # a streamed put's pieces still on their way, until its seal waits for them
        self.last_error: str | None = None
        self.stats = _new_stats(waited, evicted)
        self.stats["layers_resumed"] = adopted.resumed
        self.stats["dropped"] = adopted.dropped
        self.stats["layers_verified"] = adopted.memo.reread if adopted.memo else 0
        self.stats["layers_failed_check"] = sorted(adopted.failed)
        self._memo = adopted.memo or VerifiedMemo(folder)
        self._map_passing = False  # the last map failed for the process's sake, not the file's
        self._damaged = adopted.damaged
        self._ahead, self._written = ReadAhead(), []  # layers read in where the page cache holds them
        self._write_way = "direct"  # how layers the page cache holds are written: see write_layers
        self._parked = Parked(f"{vault.label} {key[:12]}", folder)  # written through the page cache, sealed at the close
        self.seal_behind = False  # leaving the ``with`` closes it behind (see close)
        self._measure_space()

    def _measure_space(self) -> None:
        """Recompute the room this session may still write into."""
        self.space = self.vault.space(self.key, still_needed(self._entries, self._expected))
        self._room = self.space.available
        self.writable = self.space.ok and self._room > 0
        self.stats["needed_bytes"] = self.space.needed
        self.stats["available_bytes"] = max(self.space.available, 0)
        if not self.space.ok:
            self.last_error = self.space.message

    # ----------------------------------------------------------------- reading

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A read-only mapped view of the sealed layer ``name``, or None when not cached.

        A layer whose shape or dtype differs from what is asked, or whose file no longer
        has the recorded size and header, drops the whole combination (and answers None).
        """
        self._check_open()
        entry = self._entries.get(name)
        if entry is None:
            self.stats["layers_missed"] += 1
            return None
        problem = shape_dtype_problem(entry, shape, dtype)
        view = None if problem else self._map(entry)
        if view is None:
            self._drop(problem or self._map_problem)
            self.stats["layers_missed"] += 1
            return None
        self.stats["layers_hit"] += 1
        self.stats["bytes_hit"] += entry.size
        self._read_ahead(view)
        return view

    def _read_back(self) -> None:
        """Read the layers written back in, model order, after the build (during it, 1/4 slower)."""
        order = {name: i for i, name in enumerate(self._expected or {})}
        self._written.sort(key=lambda item: order.get(item[0], len(order)))
        while self._written:  # the views then stay referenced by the read-ahead and the model only
            self._read_ahead(self._written.pop(0)[1])

    def _read_ahead(self, view: torch.Tensor) -> None:
        """Read ``view`` in behind the layers before it, where the page cache holds them (:mod:`.read_ahead`)."""
        if self._ahead.add(view):
            with self._state:
                self.stats["read_ahead_bytes"] += view.numel() * view.element_size()

    def _map(self, entry: LayerEntry) -> torch.Tensor | None:
        """Map a layer file read-only, if it still is what the manifest recorded."""
        view, self._map_problem, self._map_passing = map_recorded(self.folder, entry, self._lease, self._memo.dir)
        return view

    def _drop(self, reason: str) -> None:
        say(f"{self.vault.label} {self.key[:12]}: " + (f"not serving the combination ({reason}; a read-only root)"
            if self.vault.read_only else f"dropped the whole combination ({reason}); rebuilding it"))
        if not self.vault.read_only:
            drop_folder(self.folder)
        self._entries.clear()
        self._was_complete = False
        self.stats["dropped"] = reason
        self._measure_space()

    # ----------------------------------------------------------------- writing

    def write_layers(self, way: str) -> None:
        """Write the layers the page cache holds (the read-ahead's budget, in put order) ``way``:
        ``"direct"`` (the default: ``O_DIRECT``, read back at the close) or ``"buffered"``
        (through the page cache). :mod:`hostmem.write_way` measures which is faster here."""
        if way not in ("direct", "buffered"):
            raise ValueError(f"write way {way!r}: 'direct' or 'buffered'")
        self._write_way = way

    def put(self, name: str, merged: torch.Tensor, crc32: int | None = None,
            handoff: Handoff | None = None) -> torch.Tensor | None:
        """Write ``merged`` as layer ``name`` durably; return a read-only mapped view of it.

        ``crc32``, the CRC-32 of ``merged``'s bytes, may be given when the caller took it
        already (:func:`hostmem.crc32.crc32_of`); it is recorded as is (a wrong one
        makes ``hostmem cache verify`` report the layer). Otherwise it is taken as the
        bytes are written. With a ``handoff``, ``merged`` is the buffer a merge is still
        computing: its bytes are written as the handoff publishes them, and every byte is
        released back to the merge when the write ends, however it ends (see
        :mod:`hostmem.vault.handoff`).

        Returns None when it cannot (no room, a write error): nothing partial stays on
        disk, ``last_error`` says why (``space`` has the numbers), and later puts of this
        session answer None at once, so the caller falls back in place with one warning.
        :meth:`put_data` then :meth:`seal_put` (two threads may run them: one layer's fsync beside the next's writes)."""
        return self.seal_put(self.put_data(name, merged, crc32, handoff))

    def put_data(self, name: str, merged: torch.Tensor, crc32: int | None = None,
                 handoff: Handoff | None = None) -> UnsealedLayer | None:
        """The first half of :meth:`put`: the layer's file written under a temporary name,
        its room reserved; None where :meth:`put` answers None. Calls of this run one at a
        time, in order; each may run beside the :meth:`seal_put` of the one before.

        A streamed put (with a ``handoff``) returns once its last piece is on its way,
        so the disk's queue stays full into the next put; its :meth:`seal_put` waits for
        the pieces before the fsync, and only then is every byte handed back."""
        layer = None
        try:
            layer = self._put_data(name, merged, crc32, handoff)
            return layer
        finally:
            if layer is None and name in self._pieces:  # failed with pieces on their way: they end first
                self._pieces.pop(name).abandon()
            if handoff is not None and name not in self._pieces:
                handoff.release()

    def _put_data(self, name, merged, crc32, handoff) -> UnsealedLayer | None:
        self._check_open()
        size = layer_file_bytes(tuple(merged.shape), merged.dtype)
        with self._state:
            if self.writable and size > self._room:
                needed = max(size, still_needed(self._entries, self._expected))
                self.space = dataclasses.replace(self.space, needed=needed, available=self._room)
                self._refuse(self.space.message)
            if not self.writable:
                self.stats["layers_failed"] += 1
                return None
            self._room -= size  # reserved now: the put after this one checks what is left
            cached = self._write_way == "buffered" and self._ahead.claim(size)
        started = time.perf_counter()
        if handoff is not None and self._writer is None:
            self._writer = PieceWriter()
        writer = self._writer if handoff is not None else None
        dir_fd = None
        try:  # in the key folder's descriptor, opened from the root's once a session, not walked per layer
            dir_fd = self._memo.dir.dup()
            layer = write_layer_data(self.folder, name, merged, crc32, handoff, writer, dir_fd, cached)
        except BaseException as exc:
            if dir_fd is not None:
                os.close(dir_fd)
            if not isinstance(exc, (OSError, VaultError, SafetensorsError)):
                raise
            self._failed(name, exc)
            return None
        finally:
            if writer is not None and writer.started is not None:
                self._pieces[name], writer.started = writer.started, None
        self._write_seconds[name] = time.perf_counter() - started
        return layer

    def seal_put(self, layer: UnsealedLayer | None) -> torch.Tensor | None:
        """The second half of :meth:`put`: fsync and name the file :meth:`put_data` wrote,
        record it and map it. Several may run at once, on threads of the caller's (the
        filesystem then commits their fsyncs together); each after its :meth:`put_data`."""
        if layer is None:
            return None
        try:
            return self._seal_put(layer)
        finally:
            if layer.dir_fd is not None:
                os.close(layer.dir_fd)

    def _seal_put(self, layer: UnsealedLayer) -> torch.Tensor | None:
        name = layer.entry.name
        problem = self._end_pieces(name)
        if problem is not None and not self._seal_failed:
            discard_layer(layer)
            self._seal_failed = True
            self._failed(name, problem)
            return None
        if self._seal_failed:  # the seal before this one failed: later puts answer None
            discard_layer(layer)
            with self._state:
                self.stats["layers_failed"] += 1
            return None
        started = time.perf_counter()
        try:
            if layer.cached:  # whole in the page cache: served from the file written, sealed at the close
                entry, view = layer.entry, self._parked.park(layer, self._lease, self.seal_behind)
            else:
                entry = seal_layer(layer)
                with self._state:  # written and checksummed here: stamped, it maps with no header read
                    entry = self._memo.record(entry)
                view, _ = map_layer(os.path.join(self.folder, entry.file), name, self._lease, entry, layer.dir_fd)
        except (OSError, VaultError, SafetensorsError) as exc:
            self._seal_failed = True
            self._failed(name, exc)
            return None
        self._record_write(entry, self._write_seconds.pop(name, 0.0) + time.perf_counter() - started)
        with self._state:
            if layer.cached:  # in the page cache already; else written around it, read back at the close
                self.stats["read_ahead_bytes"] += entry.data_bytes
            else:
                self._written.append((layer.entry.name, view))
        return view

    def _end_pieces(self, name: str) -> Exception | None:
        """Wait until the pieces of ``name``'s put are written (none: its data was written
        in the put); their error, if one failed."""
        pieces = self._pieces.pop(name, None)
        try:
            if pieces is not None:
                pieces.end()
        except Exception as exc:  # an OSError of the write, or a piece cancelled
            return exc
        return None

    def _failed(self, name: str, exc: Exception) -> None:
        with self._state:
            self._refuse(f"could not write layer {name!r} to the {self.vault.label} in {self.folder}: {exc}"
                         f"{full_disk_advice(exc, self.folder)}")
            self.stats["layers_failed"] += 1

    def _record_write(self, entry: LayerEntry, seconds: float) -> None:
        with self._state:  # stamped at its seal: no later start re-reads it
            self._entries[entry.name] = entry
            self._room -= entry.size - layer_file_bytes(entry.shape, entry.torch_dtype)  # beyond what was reserved
            self.stats["layers_written"] += 1
            self.stats["bytes_written"] += entry.size
            self.stats["seconds"] += seconds
            self.stats["rate"] = self.stats["bytes_written"] / max(self.stats["seconds"], 1e-9)

    def _refuse(self, message: str) -> None:
        self.writable = False
        self.last_error = message
        self.stats["needed_bytes"] = self.space.needed
        self.stats["available_bytes"] = max(self.space.available, 0)

    # ----------------------------------------------------------------- state

    @property
    def complete(self) -> bool:
        """Every expected layer is sealed (without ``expected_layers``: the sealed manifest said so)."""
        if self._expected is None:
            return self._was_complete
        return all(
            n in self._entries and shape_dtype_problem(self._entries[n], s, d) is None
            for n, (s, d) in self._expected.items()
        )

    @property
    def layers(self) -> dict[str, LayerEntry]:
        """The layers written, by tensor name (a copy): sealed, or sealed at the close."""
        return dict(self._entries)

    @property
    def inputs(self) -> dict:
        """What the key is made of, as the manifest records it: the base's shards (path,
        size, mtime_ns and, once hashed, digest), the adapters, the dtype and the policy."""
        return self._inputs

    def _check_open(self) -> None:
        if self._closed:
            raise VaultError(f"{self.vault.label} {self.key[:12]}: session already closed")

    def close(self, behind: bool = False, also_as: tuple[str, ...] = ()) -> None:
        """Seal: make the layers written through the page cache durable and name them,
        write the manifest last, then release the lock. Never raises over a full disk.
        ``behind``: that work goes on in a thread of its own (:mod:`.behind`), the lock held
        until it is done; ``also_as``: other folders it settles (a folded build's real key,
        which then names it), which a second session in this process waits on too. The
        views served stay valid and keep the combination in use (``<key>.use``) until they
        are gone; when none is left anywhere, the use file goes."""
        if self._closed:
            return
        self._closed = True
        self._stop_writer()
        self._read_back()
        if self._lock is None:  # a read-only root: nothing was locked, nothing is written
            self._memo.dir.close()
            return
        if behind and self._parked:
            self.stats["sealed_behind"] = True
            self._parked.label = f"{self.vault.label} {os.path.basename((*also_as, self.folder)[0])[:12]}"
            seal_behind([self.folder, *also_as], self._finish_close)
        else:
            self._finish_close()

    def _finish_close(self) -> None:
        try:
            self._seal_parked()
            self._seal()
            if self.after_seal is not None:
                self.after_seal(self)
        finally:
            self._memo.dir.close()
            try:
                self._let_go_of_use()
            finally:
                self._lock.release(remove=True)  # waiters see the file gone and take a fresh one
                unclaim_in_process(self.vault.cache, self.key)

    def _close_shared(self, tidy) -> None:
        """Close a session that holds its key's lock shared (a reader, a share): ``tidy()``
        first, then the lock, its file removed only where nobody else holds it. The views
        served keep the use lease; the next plain session tidies the use file."""
        if self._closed:
            return
        self._closed = True
        self._lease = None
        try:
            self._stop_writer()
            self._seal_parked()
            tidy()
        finally:
            self._memo.dir.close()
            try:
                self._lock.release_and_remove_if_alone()
            finally:
                unclaim_in_process(self.vault.cache, self.key)

    def _seal_parked(self) -> None:
        """fsync and name the layers written through the page cache (:meth:`.behind.Parked.seal`)."""
        def sealed(entry: LayerEntry) -> None:
            with self._state:
                self._entries[entry.name] = self._memo.record(entry)

        def failed(name: str) -> None:
            with self._state:
                self._entries.pop(name, None)
                self.stats["layers_failed"] += 1

        self._parked.seal(sealed, failed)

    def _stop_writer(self) -> None:
        """End the piece writer's threads once the pieces on their way are written (all
        sealed, normally)."""
        if self._writer is not None:
            self._writer.close()

    def _let_go_of_use(self) -> None:
        """Drop the session's hold on the use lock; remove its file when no view holds it."""
        path, self._lease = self._lease.path, None
        remove_use_file_if_unused(path)

    def _unchanged(self) -> bool:
        """Nothing to seal: the session opened a sealed, complete, vouched-for combination
        and served it as it was (no put, no drop, no layer lost)."""
        return self._sealed is not None and self._entries == self._sealed and not self.stats["dropped"]

    def _seal(self) -> None:
        if not self._entries:
            remove_tree(self.folder)  # nothing built: leave nothing behind
            return
        if self._unchanged():
            touch_use_time(self.folder)  # for the LRU order; the manifest stays as it was sealed
            return
        manifest = Manifest(
            key=self.key,
            inputs=self._inputs,
            created=self._created,
            last_used=time.time(),
            complete=self.complete,
            layers=dict(self._entries),
        )
        try:
            self._memo.save(self._entries)
            write_manifest(self.folder, manifest)
            if self._damaged and manifest.complete:
                record_damage(self.folder, [])  # every layer was checked again, the bad ones rebuilt
        except OSError as exc:
            then = ("the build was provisional (its base still being hashed), so the next start builds it again"
                    if is_provisional(self.folder) else "the layers written stay and the next start adopts them")
            self.last_error = f"could not write {self.folder}/manifest.json ({exc}); {then}"
            say(self.last_error)

    def __enter__(self) -> "VaultSession":
        return self

    def __exit__(self, kind, *exc) -> None:
        self.close(behind=self.seal_behind and kind is None)  # a failed build seals what it has, now

