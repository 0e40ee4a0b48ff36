"""The vault: layers stored once on disk and served as read-only mappings.

Its providers: the LoRA cache's merged layers, and checkpoint remap's spill (weights
cast or changed at load, :mod:`hostmem.remapping.spill`). Both key a combination by content.

A pure store. ``Vault(root).open(key, expected_layers)`` returns a
:class:`VaultSession` whose ``get(name, shape, dtype)`` answers a view into a
read-only mapping of a sealed layer file (or None) and whose ``put(name, merged)``
writes a layer durably and answers a view of what was written (or None when it
cannot: then the caller merges in place). It never touches nn state.

Layout::

    <root>/lora_merge_cache/<key>/manifest.json          (see manifest)
    <root>/lora_merge_cache/<key>/<32 hex>.safetensors   one layer each (see layer_file)
    <root>/lora_merge_cache/<key>/verified.json          memo of layer files checked (see verification)
    <root>/lora_merge_cache/<key>/damage.json            what `cache verify` (or a reader) found damaged
    <root>/lora_merge_cache/<key>/provisional.json       a build not re-keyed yet: never served (see fold)
    <root>/lora_merge_cache/<key>.lock                   the key's flock (sessions)
    <root>/lora_merge_cache/<key>.use                    held shared while served weights live
    <root>/lora_merge_cache/content_hashes.json         memo of input content digests

Contract, in the order it happens:

- ``Vault(root)`` refuses a root (or a cache folder under it) that another user owns or
  that others may write without the sticky bit, and one on tmpfs; it removes the
  temporary files of writers that are no longer running, anywhere under the root. A
  root this process cannot write is read-only: never written, not even a lock file;
  its sessions serve what is there and verified, and every put answers None.
- ``open`` takes the key's exclusive flock. A second process opening the same key
  meanwhile prints that it waits, waits, then adopts what the first built. The
  kernel releases the lock of a process that dies, so a crash never wedges a key.
  A combination sealed complete whose every layer is memoised as verified (below) is
  only mapped, so ``open`` takes its flock SHARED instead, and any number of such
  readers map it at once; every writer still excludes them (see ``readers``).
  No wait is without end: a lock another user holds (a root others can read) is
  named, a sealed combination served without it, else a copy of this user's own
  built beside it under :func:`~.store.alternate_key` (see ``locks``).
- Adoption checks each recorded layer's size and header; layer files a killed build
  sealed but never recorded are adopted on their own header, so a build resumes
  where it died. Every layer's content must then match its CRC-32 unless it is
  memoised as written or verified and unchanged since (same inode, size, mtime,
  ctime): a layer that fails is removed, named with the reason, and rebuilt. A
  manifest that cannot be read, or layers of another shape or dtype than asked, drop
  the WHOLE combination. The cache never serves a torn, stale or damaged file. A
  sealed, complete manifest whose every layer is so memoised is taken without reading
  the headers, and ``get`` maps each file at the data offset the manifest records while
  the file keeps the stamp it was verified at (else it reads the header and checks it).
- Least-recently-used combinations are evicted while the cache would exceed
  ``max_size`` or the disk would keep less than ``headroom`` free; a combination in
  use is never evicted: open in a session somewhere, or serving weights somewhere
  (every view ``get`` and ``put`` return holds a shared lock on ``<key>.use`` for as
  long as it lives, after the session too; see ``leases``).
- If the expected bytes still do not fit, ``put`` answers None, ``last_error`` says
  how many bytes were needed and how many were available and how to make room, and
  ``session.space`` holds the numbers; what happens next is the caller's choice.
- Closing the session writes the manifest last (the seal) and releases the lock;
  a session that served a sealed combination as it was only sets the manifest's mtime
  (its use, for the LRU order). The views it served keep the combination in use until
  they are gone. Layers written through the page cache are served from their files at
  once and fsynced and named at the close, which may go on in a thread while the start
  runs (``close(behind=True)``, :mod:`.behind`): the lock is held until it is done.

The default root is ``~/.cache/hostmem``; the environment variable
``HOSTMEM_CACHE_ROOT`` overrides it (:func:`default_cache_root`).

Modules, each with one job:

- ``store``: :class:`Vault`, a cache root, where combinations are opened;
- ``session``: :class:`VaultSession`, one open combination: get, put, seal;
- ``behind``: a build's seal finished by a thread while the start goes on (:func:`wait_sealed`);
- ``readers``: a sealed, verified combination opened only to map it, lock held shared;
- ``space``: room for a build (:class:`SpaceCheck`);
- ``verification``: a layer is served only once its checksum matched;
- ``content_hash``: whole-file digests of the inputs, memoised;
- ``identity``: the key of a combination and the content hashes it is made of;
- ``fold``: a base not hashed yet is hashed beside its build, under a provisional key;
- ``provisional``: the marker of such a build, never served; ``rekey``: its real key;
- ``layer_file``: one merged layer as one self-describing safetensors file;
- ``manifest``: the seal over a combination's layer files;
- ``adoption``: what an opening session may trust of a folder;
- ``combinations``: the combinations on disk, their sizes, locks and eviction;
- ``roots``: several roots in order, which one serves or builds a combination;
- ``leases``: served weights keep their combination in use;
- ``admin``: ``hostmem cache ls | verify | prune | rm``;
- ``safety``, ``durable``, ``locks``: the filesystem underneath (private folders,
  crash-safe writes, flocks).

Names are imported on first use, and the modules ``admin`` needs (manifests, layer
headers, checksums, locks) do not import torch: ``hostmem cache`` starts light.
"""

from hostmem.lazy import lazy_exports

_EXPORTS = {
    "Vault": "store",
    "VaultSession": "session",
    "VaultError": "safety",
    "SpaceCheck": "space",
    "CacheKey": "identity",
    "cache_key": "identity",
    "base_identity": "identity",
    "adapter_identity": "identity",
    "default_cache_root": "combinations",
    "cache_roots": "roots",
    "open_in_roots": "roots",
    "DEFAULT_HEADROOM": "store",
    "layer_file_bytes": "layer_file",
    "wait_sealed": "behind",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
