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
combination a hit. The process waits for its seals at exit (the thread is not a daemon);
:func:`wait_sealed` waits for them sooner, and a second session on the same key in this
process waits for the first's seal before it opens.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

from .layer_file import UnsealedLayer, complete_layer, discard_layer, seal_completed
from .leases import map_open_layer
from .locks import say
from .space import full_disk_advice

__all__ = ["Parked", "seal_behind", "wait_sealed"]

_PENDING: dict[str, threading.Thread] = {}  # a combination's folder (real path) -> its sealing thread
_PENDING_LOCK = threading.Lock()


class Parked:
    """Layer files complete in the page cache, neither durable nor named yet; each with a
    descriptor of its folder of its own."""

    def __init__(self, label: str, folder: str):
        self._label, self._folder = label, folder  # the combination, as its errors name it
        self._layers: list[UnsealedLayer] = []

    def __bool__(self) -> bool:
        return bool(self._layers)

    def park(self, layer: UnsealedLayer, lease) -> "torch.Tensor":
        """Complete ``layer`` (its header written) and keep it for :meth:`seal`; a read-only
        view of it, mapped from its writer's descriptor, holding ``lease``. Its descriptor
        is now the parking's, its folder's descriptor stays the caller's. On any error its
        file is removed and the error raised."""
        complete_layer(layer)
        try:
            view = map_open_layer(layer.fd, lease, layer.entry)
            dir_fd = None if layer.dir_fd is None else os.dup(layer.dir_fd)
        except BaseException:
            discard_layer(layer)
            raise
        self._layers.append(layer._replace(dir_fd=dir_fd))
        return view

    def seal(self, sealed: Callable, failed: Callable) -> None:
        """fsync and name every parked layer, in the order parked: ``sealed(entry)`` for
        each that is, ``failed(name)`` for each that could not be (its file removed, the
        error said: the next start builds it again)."""
        while self._layers:
            layer = self._layers.pop(0)
            try:
                entry = seal_completed(layer)
            except OSError as exc:
                failed(layer.entry.name)
                say(f"{self._label}: could not make layer {layer.entry.name!r} durable ({exc}); the weights served "
                    f"are this process's copy, and the next start builds it again{full_disk_advice(exc, self._folder)}")
                continue
            finally:
                if layer.dir_fd is not None:
                    os.close(layer.dir_fd)
            sealed(entry)


def seal_behind(folder: str, rest: Callable[[], None]) -> None:
    """Run ``rest`` (what is left of closing ``folder``'s session) on a thread of its own,
    which the process waits for at exit; any error is said, never raised."""
    thread = threading.Thread(target=_run, args=(folder, rest), name="hostmem-vault-seal")
    with _PENDING_LOCK:
        _PENDING[os.path.realpath(folder)] = thread
    thread.start()


def _run(folder: str, rest: Callable[[], None]) -> None:
    try:
        rest()
    except BaseException as exc:  # a thread's error would be a bare traceback, and lose the reason
        say(f"could not seal the LoRA merge cache's build in {folder} ({type(exc).__name__}: {exc}); the served "
            "weights are unchanged, and the next start builds again what was not sealed")
    finally:
        with _PENDING_LOCK:
            if _PENDING.get(os.path.realpath(folder)) is threading.current_thread():
                del _PENDING[os.path.realpath(folder)]


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
