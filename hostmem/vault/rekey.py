"""Re-keying a provisional combination once its base's digests are known.

Runs while the provisional session still holds its key's lock, after its seal (see
:mod:`hostmem.vault.fold`), and takes the real key's lock too, so neither folder can
change meanwhile. Then, in this order, each step durable before the next:

1. the real combination is complete in some root already (another start built it
   meanwhile): the provisional folder goes, and that one is the combination;
2. else the manifest is rewritten with the real key and inputs (the layer files and
   their checksums stay as written), the folder is renamed to the real key (replacing
   a partial combination nobody serves), the served weights' use lease carries over to
   the real key, and the marker goes last.

A crash before the marker goes leaves a marked folder, under either key, that is never
served and that the dead-writer sweep removes (:mod:`hostmem.vault.provisional`); a
crash after it leaves the complete combination under its real key.
"""

from __future__ import annotations

import os
import time

from .anchor import rename_in
from .combinations import lock_path, use_path
from .deferred import interrupts_deferred
from .durable import discard, fsync_dir, remove_tree
from .identity import CacheKey
from .leases import use_lease
from .locks import KeyLock, describe_holders, lock_holders, lock_is_held
from .manifest import ManifestError, read_manifest, write_manifest
from .provisional import is_provisional, unmark_provisional
from .safety import VaultError, check_folder_safe
from .claims import claim_in_process, unclaim_in_process
from .session import say

__all__ = ["rekey", "complete_in"]


def complete_in(vaults: list, key: str):
    """The first of ``vaults`` holding ``key``'s combination sealed complete (and not
    provisional), or None. Its layers are verified when a start opens it."""
    for vault in vaults:
        folder = os.path.join(vault.cache, key)
        if not os.path.isdir(folder) or os.path.islink(folder) or is_provisional(folder):
            continue
        try:
            check_folder_safe(folder)  # another user's folder is never adopted, whatever it holds
            manifest = read_manifest(folder)
        except (ManifestError, VaultError, OSError):
            continue
        if manifest is not None and manifest.complete and manifest.key == key:
            return vault
    return None


def _take(lock: KeyLock, label: str, key: str, wait: bool = True) -> bool:
    """Take the real key's lock, saying so when another process holds it; False where it
    is still held after the bounded wait (:meth:`~.locks.KeyLock.acquire_within`), or at
    once without ``wait``."""
    if lock.acquire(blocking=False):
        return True
    if wait:
        say(f"{label} {key[:12]} is in use by another process; waiting for it before naming this build by it")
        started = time.monotonic()
        if lock.acquire_within():
            say(f"{label} {key[:12]}: waited {time.monotonic() - started:.1f} s")
            return True
    say(f"{label} {key[:12]}: its lock is held by {describe_holders(lock_holders(lock.path))}; the "
        "weights merged are served from the build as it is, left under its provisional key")
    return False


def _carry_lease(cache: str, provisional: str, real: str) -> None:
    """The weights served from the provisional folder hold its use lease; from now on they
    hold the real key's as well (the provisional lease keeps it alive), so eviction
    leaves the re-keyed combination alone while they live. Both locks are held: nobody
    can be taking or removing either lease file."""
    old = use_path(cache, provisional)
    lease = use_lease(old)
    lease.successor = use_lease(use_path(cache, real))
    discard(old)  # still locked by the lease's descriptor; nobody can find it any more


def _name_by(cache: str, folder: str, target: str, manifest, provisional: str, real: CacheKey) -> None:
    """Step 2 of the module's docstring: the manifest, the lease, the name, the marker."""
    remove_tree(target)
    manifest.key, manifest.inputs = real.hex, real.inputs
    write_manifest(folder, manifest)
    _carry_lease(cache, provisional, real.hex)
    rename_in(folder, target)  # in the cache folder's descriptor, walked from the root's
    fsync_dir(cache)
    unmark_provisional(target)


def _give_up(label: str, cache: str, provisional: str, real: str, exc: OSError) -> None:
    """The re-key failed part way (a full disk, most often): the weights served were built
    from the very inputs the real key names and stay mapped from their files, which go
    with the folder (unlinked, alive while mapped); nothing half-named stays behind, and
    the next start builds the combination again. Said once."""
    for key in (provisional, real):
        if os.path.isdir(os.path.join(cache, key)) and is_provisional(os.path.join(cache, key)):
            remove_tree(os.path.join(cache, key))
    discard(use_path(cache, provisional))
    say(f"{label} {real[:12]}: could not store the build under its key ({exc}); the weights it merged are "
        "served as they are, and the next start builds it again")


def rekey(vault, provisional: str, real: CacheKey, vaults: list, wait: bool = True):
    """Name the sealed provisional combination ``provisional`` of ``vault`` by ``real``
    (see the module's docstring); the vault the combination is served from now. ``wait``:
    for another process that holds ``real``'s lock (a bounded wait), else leave it."""
    cache = vault.cache
    folder = os.path.join(cache, provisional)
    manifest = read_manifest(folder) if os.path.isdir(folder) else None
    if manifest is None:  # nothing was built: the session left nothing behind
        remove_tree(folder)
        return vault
    claim_in_process(cache, real.hex)
    lock = KeyLock(lock_path(cache, real.hex))
    try:
        if not _take(lock, vault.label, real.hex, wait):
            return vault
        with interrupts_deferred():  # half re-keyed, a finished build would be swept and built again
            return _rekey_held(vault, folder, manifest, provisional, real, vaults)
    finally:
        lock.release(remove=True)
        unclaim_in_process(cache, real.hex)


def _rekey_held(vault, folder: str, manifest, provisional: str, real: CacheKey, vaults: list):
    """:func:`rekey` once the real key's lock is held."""
    cache = vault.cache
    holder = complete_in(vaults, real.hex)
    target = os.path.join(cache, real.hex)
    if holder is None and os.path.lexists(target) and lock_is_held(use_path(cache, real.hex), shared_too=True):
        holder = vault  # a partial one some process serves: it stays, the next start completes it
    if holder is not None:
        remove_tree(folder)  # the weights served from it live on in its unlinked files
        discard(use_path(cache, provisional))  # and hold its unlinked lease file
        return holder
    try:
        _name_by(cache, folder, target, manifest, provisional, real)
    except OSError as exc:  # no room for the manifest, an I/O error: what is served stays right
        _give_up(vault.label, cache, provisional, real.hex, exc)
    return vault
