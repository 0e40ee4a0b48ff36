"""Sealed behind the start: a build's layers served at once from the page cache, made
durable by a thread of the process while the model runs.

A layer written through the page cache (:meth:`VaultSession.write_layers`, the read-ahead's
budget) is whole in memory once its header is written: its mapping serves what the
merge computed, as an in-place merge's heap would. What is left is the cache's own
business: fsync each file, give it its final name, write the manifest, release the
key's lock. Done in the build, that work puts the merged model's bytes on the disk
while the build still reads the base from it, and the start waits for both: 1 GiB of
layers took 1.4-2.2 s to start that way, 1.0-1.4 s with the durable part left until
after the start, against 1.3-1.7 s in place (AMD EPYC, 2 cores, a virtio disk).

So a session closed ``behind`` (:meth:`VaultSession.close`) hands that rest to a thread
of its own, and the start goes on. Nothing is served to anyone else before it is done:
the key's lock stays held (another process that opens the key waits, then adopts what
is sealed), the files keep their temporary names (a killed process leaves them to the
next start's sweep, never to be served), and only the manifest written last makes the
combination a hit. The process waits for its seals at exit (the thread is not a daemon),
and says so where the wait is long; :func:`wait_sealed` waits for them sooner, and a
second session on the same key in this process waits for the first's seal before it opens.

A parked layer's pages are dirty: the page cache cannot drop them before they are
written, and a memory cgroup charges them. So a build sealed behind lets at most
:data:`DIRTY_SHARE` of the page cache's room (:func:`~.read_ahead.page_cache_room`,
the cgroup's where it is tighter; the kernel's own default background ratio) wait
unwritten: past it, the disk is started on the oldest parked layers, without waiting.
(Started on every layer as it was written, the same 1 GiB started in 1.40-1.79 s
against 1.01-1.55 s.) A build whose close seals in the start starts the disk on each
layer as it is parked, so the disk writes while the build sums.

A first build on a base not hashed yet (:mod:`.fold`) is sealed behind its start too:
the start waits for the hash only, so that it reports the real key; the seal and the
re-key run on the thread, which :func:`wait_sealed` finds under either key's folder.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Callable

from hostmem.file_writes import start_writeback
from hostmem.units import format_size

from .layer_file import UnsealedLayer, complete_layer, discard_layer, seal_completed
from .leases import map_open_layer
from .locks import say
from .read_ahead import page_cache_room
from .space import full_disk_advice

if TYPE_CHECKING:
    import torch

__all__ = ["DIRTY_SHARE", "Parked", "seal_behind", "wait_sealed"]

DIRTY_SHARE = 0.1  # of the page cache's room: parked bytes left unwritten before the disk is started on them

_SAY_FROM = 1 << 30  # bytes left to seal at exit that are worth a line
_PENDING: dict[str, threading.Thread] = {}  # a combination's folder (real path) -> its sealing thread
_PENDING_LOCK = threading.Lock()


class Parked:
    """Layer files complete in the page cache, neither durable nor named yet; each with a
    descriptor of its folder of its own."""

    def __init__(self, label: str, folder: str):
        self.label, self._folder = label, folder  # the combination, as what the seal says names it
        self._layers: list[UnsealedLayer] = []
        self._unstarted = 0  # bytes of the last parked layers, from _layers[_started:], not started on the disk
        self._started = 0
        self._dirty_cap: int | None = None  # measured at the first park

    def __bool__(self) -> bool:
        return bool(self._layers)

    def park(self, layer: UnsealedLayer, lease, behind: bool) -> torch.Tensor:
        """Complete ``layer`` (its header written) and keep it for :meth:`seal`; a read-only
        view of it, mapped from its writer's descriptor, holding ``lease``. Its descriptor
        is now the parking's, its folder's descriptor stays the caller's. On any error its
        file is removed and the error raised. ``behind``: the seal will run behind the
        start, so the layer may wait unwritten (within the cap); else the close waits for
        it, and the disk is started on it at once."""
        complete_layer(layer)
        try:
            view = map_open_layer(layer.fd, lease, layer.entry)
            dir_fd = None if layer.dir_fd is None else os.dup(layer.dir_fd)
        except BaseException:
            discard_layer(layer)
            raise
        self._layers.append(layer._replace(dir_fd=dir_fd))
        self._unstarted += layer.entry.size
        self._start_past_cap(behind)
        return view

    def _start_past_cap(self, behind: bool) -> None:
        """Start the disk on the oldest parked layers while the unwritten ones pass the cap
        (none, where the seal is not behind the start)."""
        if not behind:
            self._dirty_cap = 0
        elif self._dirty_cap is None:
            self._dirty_cap = int(DIRTY_SHARE * page_cache_room())
        while self._unstarted > self._dirty_cap and self._started < len(self._layers):
            layer = self._layers[self._started]
            start_writeback(layer.fd, 0, layer.entry.size)
            self._unstarted -= layer.entry.size
            self._started += 1

    def seal(self, sealed: Callable, failed: Callable) -> None:
        """fsync and name every parked layer, in the order parked: ``sealed(entry)`` for
        each that is, ``failed(name)`` for each that could not be (its file removed, the
        error said: the next start builds it again)."""
        left, said = sum(layer.entry.size for layer in self._layers), False
        self._started = self._unstarted = 0
        while self._layers:
            layer = self._layers.pop(0)
            if not said and left >= _SAY_FROM and not threading.main_thread().is_alive():
                said = True  # the process is exiting and waits for this: a silent wait would look hung
                say(f"{self.label}: making {format_size(left)} of merged layers durable before the process exits")
            left -= layer.entry.size
            try:
                entry = seal_completed(layer)
            except OSError as exc:
                failed(layer.entry.name)
                say(f"{self.label}: could not make layer {layer.entry.name!r} durable ({exc}); the weights served "
                    f"are this process's copy, and the next start builds it again{full_disk_advice(exc, self._folder)}")
                continue
            finally:
                if layer.dir_fd is not None:
                    os.close(layer.dir_fd)
            sealed(entry)


def seal_behind(folders: list[str], rest: Callable[[], None]) -> None:
    """Run ``rest`` (what is left of closing the session of ``folders[0]``) on a thread of
    its own, which the process waits for at exit, and which :func:`wait_sealed` of any of
    ``folders`` waits for; any error is said, never raised. Where no thread can be started
    (none left, the interpreter shutting down), here and now."""
    thread = threading.Thread(target=_run, args=(folders[0], rest), name="hostmem-vault-seal")
    names = [os.path.realpath(folder) for folder in folders]
    with _PENDING_LOCK:
        _PENDING.update(dict.fromkeys(names, thread))
    try:
        thread.start()
    except RuntimeError:
        _forget(thread)
        rest()


def _forget(thread: threading.Thread) -> None:
    """``thread`` is done: no folder waits for it any more."""
    with _PENDING_LOCK:
        for name in [name for name, pending in _PENDING.items() if pending is thread]:
            del _PENDING[name]


def _run(folder: str, rest: Callable[[], None]) -> None:
    try:
        rest()
    except BaseException as exc:  # a thread's error would be a bare traceback, and lose the reason
        say(f"could not seal the LoRA merge cache's build in {folder} ({type(exc).__name__}: {exc}); the served "
            "weights are unchanged, and the next start builds again what was not sealed")
    finally:
        _forget(threading.current_thread())


def wait_sealed(folder: str | None = None, timeout: float | None = None) -> bool:
    """Wait until the builds this process sealed behind their start are sealed: all of
    them, or ``folder``'s (a combination's folder) only. False if ``timeout`` seconds
    ran out first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with _PENDING_LOCK:
        threads = [t for f, t in _PENDING.items() if folder is None or f == os.path.realpath(folder)]
    for thread in threads:
        if thread is threading.current_thread():
            continue
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            return False
    return True
