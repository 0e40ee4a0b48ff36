"""The vault: LoRA-merged layers stored once on disk and served as read-only mappings.

A pure store. ``Vault(root).open(key, expected_layers)`` returns a
:class:`VaultSession` whose ``get(name, shape, dtype)`` answers a view into a
read-only mapping of a sealed layer file (or None) and whose ``put(name, merged)``
writes a layer durably and answers a view of what was written (or None when it
cannot: then the caller merges in place). It never touches nn state.

Layout::

    <root>/lora_merge_cache/<key>/manifest.json          (see vault_manifest)
    <root>/lora_merge_cache/<key>/<32 hex>.safetensors   one layer each (see vault_layer)
    <root>/lora_merge_cache/<key>.lock                   the key's flock (sessions)
    <root>/lora_merge_cache/<key>.use                    held shared while served weights live
    <root>/lora_merge_cache/adapter_hashes.json          memo of adapter content hashes

Contract, in the order it happens:

- ``open`` takes the key's exclusive flock. A second process opening the same key
  meanwhile prints that it waits, waits, then adopts what the first built. The
  kernel releases the lock of a process that dies, so a crash never wedges a key.
- Adoption checks each recorded layer's size and header; layer files a killed build
  sealed but never recorded are adopted on their own header, so a build resumes
  where it died. A mismatched entry (size, header, shape or dtype differing from
  what is recorded or asked) drops the WHOLE combination, which is then rebuilt:
  the cache never serves a torn or stale file.
- Least-recently-used combinations are evicted while the cache would exceed
  ``max_size`` or the disk would keep less than ``headroom`` free; a combination in
  use is never evicted: open in a session somewhere, or serving weights somewhere
  (every view ``get`` and ``put`` return holds a shared lock on ``<key>.use`` for as
  long as it lives, after the session too; see ``vault_use``).
- If the expected bytes still do not fit, ``put`` answers None, ``last_error`` says
  how many bytes were needed and how many were available and how to make room, and
  ``session.space`` holds the numbers; what happens next is the caller's choice.
- Closing the session writes the manifest last (the seal) and releases the lock;
  the views it served keep the combination in use until they are gone.

The default root is ``~/.cache/hostmem``; the environment variable
``HOSTMEM_CACHE_ROOT`` overrides it (:func:`default_cache_root`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass

import torch

from hostmem.safetensors_map import SafetensorsError
from hostmem.units import format_size, parse_size

from .handoff import Handoff
from .vault_adopt import adopt, drop_folder, shape_dtype_problem
from .vault_fs import (
    KeyLock,
    VaultError,
    check_not_symlink,
    free_bytes,
    make_private_dir,
    prepare_root,
    remove_tree,
)
from .vault_key import CacheKey, adapter_identity, base_identity, cache_key
from .vault_layer import LayerEntry, layer_file_bytes, write_layer
from .vault_manifest import Manifest, write_manifest
from .vault_store import cache_bytes, cache_dir, evict_lru, is_key, list_combinations, lock_path, use_path
from .vault_use import lease_alive, map_layer, use_lease

__all__ = [
    "Vault",
    "VaultSession",
    "VaultError",
    "SpaceCheck",
    "CacheKey",
    "cache_key",
    "base_identity",
    "adapter_identity",
    "default_cache_root",
    "DEFAULT_HEADROOM",
    "layer_file_bytes",
]

DEFAULT_HEADROOM = 256 * 1024 * 1024
_OPEN_KEYS: set[str] = set()  # keys open in this process: a second flock of ours would deadlock
_OPEN_KEYS_LOCK = threading.Lock()


def default_cache_root() -> str:
    """``$HOSTMEM_CACHE_ROOT`` if set, else ``~/.cache/hostmem``."""
    return os.environ.get("HOSTMEM_CACHE_ROOT") or os.path.join(os.path.expanduser("~"), ".cache", "hostmem")


def _say(message: str) -> None:
    print(f"hostmem: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class SpaceCheck:
    """Room for a build: what it needs against what the disk and ``max_size`` allow.

    ``available`` is the smaller of (free disk - headroom) and (max_size - bytes the
    cache already holds); ``needed`` is what the layers still to write take.
    """

    needed: int
    available: int
    free_disk: int
    headroom: int
    max_size: int | None
    folder: str

    @property
    def ok(self) -> bool:
        return self.needed <= self.available

    @property
    def message(self) -> str:
        limit = f", max_size {format_size(self.max_size)}" if self.max_size is not None else ""
        return (
            f"no room for the LoRA merge cache in {self.folder}: needs {format_size(self.needed)}, "
            f"{format_size(max(self.available, 0))} available ({format_size(self.free_disk)} free on disk, "
            f"keeping {format_size(self.headroom)} headroom{limit}). Free disk space, raise max_size, "
            "or run `hostmem cache prune`."
        )


def _claim_in_process(key: str) -> None:
    with _OPEN_KEYS_LOCK:
        if key in _OPEN_KEYS:
            raise VaultError(f"LoRA merge cache {key[:12]} is already open in this process; close that session first")
        _OPEN_KEYS.add(key)


def _unclaim_in_process(key: str) -> None:
    with _OPEN_KEYS_LOCK:
        _OPEN_KEYS.discard(key)


def _lock_key(cache: str, key: str) -> tuple[KeyLock, float]:
    """Take the key's exclusive lock, saying so when another process holds it."""
    lock = KeyLock(lock_path(cache, key))
    if os.path.lexists(lock.path):
        check_not_symlink(lock.path)
    if lock.acquire(blocking=False):
        return lock, 0.0
    _say(
        f"LoRA merge cache {key[:12]} is in use by another process (most likely building it); waiting "
        f"for it to finish (lock {lock.path}), then using what it built"
    )
    started = time.monotonic()
    lock.acquire()
    waited = time.monotonic() - started
    _say(f"LoRA merge cache {key[:12]}: waited {waited:.1f} s; adopting it")
    return lock, waited


class Vault:
    """A cache root. Cheap to create; all work happens in :meth:`open`."""

    def __init__(self, root: str | os.PathLike, max_size: int | str | None = None, headroom: int | str = DEFAULT_HEADROOM):
        self.root = prepare_root(root)
        self.cache = cache_dir(self.root)
        self.max_size = None if max_size is None else parse_size(max_size)
        self.headroom = parse_size(headroom)

    @property
    def memo_file(self) -> str:
        """The on-disk memo of adapter content hashes (a hint: losing it costs a rehash)."""
        return os.path.join(self.cache, "adapter_hashes.json")

    def adapter_identity(self, path: str, strength: float, alpha_override: float | None) -> dict:
        """:func:`adapter_identity` with the memo kept under this root across starts."""
        return adapter_identity(path, strength, alpha_override, memo_file=self.memo_file)

    def combinations(self):
        """Every combination on disk, least recently used first (see ``vault_store``)."""
        return list_combinations(self.cache)

    def space(self, key: str, needed: int) -> SpaceCheck:
        """How much of ``needed`` fits now, by free disk and by ``max_size``."""
        free = free_bytes(self.cache)
        available = free - self.headroom
        if self.max_size is not None:
            available = min(available, self.max_size - cache_bytes(self.cache))
        return SpaceCheck(needed, available, free, self.headroom, self.max_size, os.path.join(self.cache, key))

    def open(self, key: CacheKey | str, expected_layers: dict | None = None) -> "VaultSession":
        """Lock, adopt, make room, and return a session (see the module's contract)."""
        hex_key = key.hex if isinstance(key, CacheKey) else str(key)
        if not is_key(hex_key):
            raise VaultError(f"{hex_key!r} is not a cache key (64 lowercase hex digits from cache_key())")
        _claim_in_process(hex_key)
        lock = None
        try:
            lock, waited = _lock_key(self.cache, hex_key)
            lease = use_lease(use_path(self.cache, hex_key))  # under the key's lock, before any view
            folder = os.path.join(self.cache, hex_key)
            make_private_dir(folder)
            adopted = adopt(folder, expected_layers)
            if adopted.dropped:
                _say(f"LoRA merge cache {hex_key[:12]}: dropped the whole combination ({adopted.dropped}); rebuilding it")
            needed = _still_needed(adopted.entries, expected_layers)
            evicted = evict_lru(self.cache, hex_key, needed, self.max_size, self.headroom)
            inputs = key.inputs if isinstance(key, CacheKey) else {}
            return VaultSession(self, hex_key, folder, (lock, lease), inputs, adopted, expected_layers, waited, evicted)
        except BaseException:
            if lock is not None:
                lock.release()
            _unclaim_in_process(hex_key)
            raise


def _still_needed(entries: dict[str, LayerEntry], expected: dict | None) -> int:
    """Bytes of the expected layers not yet sealed."""
    return sum(layer_file_bytes(s, d) for n, (s, d) in (expected or {}).items() if n not in entries)


def _new_stats(waited: float, evicted) -> dict:
    return {
        "layers_hit": 0,
        "layers_missed": 0,
        "layers_written": 0,
        "layers_failed": 0,
        "layers_resumed": 0,
        "bytes_hit": 0,
        "bytes_written": 0,
        "seconds": 0.0,
        "rate": 0.0,
        "lock_wait_seconds": waited,
        "evicted": [c.key for c in evicted],
        "evicted_bytes": sum(c.bytes for c in evicted),
        "needed_bytes": 0,
        "available_bytes": 0,
        "dropped": None,
    }


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
        self._expected = expected
        self._closed = False
        self._map_problem = ""
        self.last_error: str | None = None
        self.stats = _new_stats(waited, evicted)
        self.stats["layers_resumed"] = adopted.resumed
        self.stats["dropped"] = adopted.dropped
        self._measure_space()

    def _measure_space(self) -> None:
        """Recompute the room this session may still write into."""
        self.space = self.vault.space(self.key, _still_needed(self._entries, self._expected))
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
        return view

    def _map(self, entry: LayerEntry) -> torch.Tensor | None:
        """Map a layer file read-only, if it still is what the manifest recorded."""
        path = os.path.join(self.folder, entry.file)
        try:
            check_not_symlink(path)
            view, header = map_layer(path, entry.name, self._lease)
        except (SafetensorsError, OSError) as exc:
            self._map_problem = str(exc)
            return None
        if header.file_size != entry.size or header.header_sha256 != entry.header_sha256:
            self._map_problem = f"{path}: size or header changed since it was sealed"
            return None
        return view

    def _drop(self, reason: str) -> None:
        _say(f"LoRA merge cache {self.key[:12]}: dropped the whole combination ({reason}); rebuilding it")
        drop_folder(self.folder)
        self._entries.clear()
        self._was_complete = False
        self.stats["dropped"] = reason
        self._measure_space()

    # ----------------------------------------------------------------- writing

    def put(self, name: str, merged: torch.Tensor, crc32: int | None = None,
            handoff: Handoff | None = None) -> torch.Tensor | None:
        """Write ``merged`` as layer ``name`` durably; return a read-only mapped view of it.

        ``crc32``, the CRC-32 of ``merged``'s bytes, may be given when the caller took it
        already (:func:`lora_cache.crc32.crc32_of`); it is recorded as is (a wrong one
        makes ``hostmem cache verify`` report the layer). Otherwise it is taken as the
        bytes are written. With a ``handoff``, ``merged`` is the buffer a merge is still
        computing: its bytes are written as the handoff publishes them, and every byte is
        released back to the merge when the put ends, however it ends (see
        :mod:`lora_cache.handoff`).

        Returns None when it cannot (no room, a write error): nothing partial stays on
        disk, ``last_error`` says why (``space`` has the numbers), and later puts of this
        session answer None at once, so the caller falls back in place with one warning.
        """
        try:
            return self._put(name, merged, crc32, handoff)
        finally:
            if handoff is not None:
                handoff.release()

    def _put(self, name, merged, crc32, handoff) -> torch.Tensor | None:
        self._check_open()
        size = layer_file_bytes(tuple(merged.shape), merged.dtype)
        if self.writable and size > self._room:
            needed = max(size, _still_needed(self._entries, self._expected))
            self.space = SpaceCheck(needed, self._room, *_space_tail(self.space))
            self._refuse(self.space.message)
        if not self.writable:
            self.stats["layers_failed"] += 1
            return None
        started = time.perf_counter()
        try:
            entry = write_layer(self.folder, name, merged, crc32, handoff)
            view, _ = map_layer(os.path.join(self.folder, entry.file), name, self._lease)
        except (OSError, VaultError, SafetensorsError) as exc:
            self._refuse(f"could not write layer {name!r} to the LoRA merge cache in {self.folder}: {exc}")
            self.stats["layers_failed"] += 1
            return None
        self._record_write(entry, time.perf_counter() - started)
        return view

    def _record_write(self, entry: LayerEntry, seconds: float) -> None:
        self._entries[entry.name] = entry
        self._room -= entry.size
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
        """The sealed layers, by tensor name (a copy)."""
        return dict(self._entries)

    def _check_open(self) -> None:
        if self._closed:
            raise VaultError(f"LoRA merge cache {self.key[:12]}: session already closed")

    def close(self) -> None:
        """Seal: write the manifest last, then release the lock. Never raises over a full disk.

        The views served stay valid and keep the combination in use (``<key>.use``)
        until they are gone; when none is left anywhere, the use file goes too.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._seal()
        finally:
            try:
                self._let_go_of_use()
            finally:
                self._lock.release(remove=True)  # waiters see the file gone and take a fresh one
                _unclaim_in_process(self.key)

    def _let_go_of_use(self) -> None:
        """Drop the session's hold on the use lock; remove its file when no view holds it."""
        path, self._lease = self._lease.path, None
        if lease_alive(path):
            return  # views of this process live on
        probe = KeyLock(path)
        if os.path.lexists(path) and probe.acquire(blocking=False):  # no other process's views either
            probe.release(remove=True)  # under the key's lock: nobody is taking a lease now

    def _seal(self) -> None:
        if not self._entries:
            remove_tree(self.folder)  # nothing built: leave nothing behind
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
            write_manifest(self.folder, manifest)
        except OSError as exc:
            self.last_error = (
                f"could not write {self.folder}/manifest.json ({exc}); the layers written stay and the "
                "next start adopts them"
            )
            _say(self.last_error)

    def __enter__(self) -> "VaultSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _space_tail(space: SpaceCheck) -> tuple:
    return space.free_disk, space.headroom, space.max_size, space.folder
