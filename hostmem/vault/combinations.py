"""The combinations on disk: finding them, sizing them, removing them when unused.

A combination is in use while some process holds its key's lock (a session is
open: building, resuming or adopting) or a shared lock on its ``.use`` file (weights
served from it are still alive somewhere: see ``leases``). Removal takes both
locks without waiting and gives up when it cannot, so eviction, ``prune`` and ``rm``
never pull files from under a build, nor from under a server that maps them (which
would free no disk until that server exits, yet count the bytes freed).

Lock files live next to the combination folders (``<key>.lock``, ``<key>.use``), not
inside them, so a folder can be removed while its locks are held.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field

from ..errors import InputError
from .anchor import listdir_in, open_folder
from .durable import TMP_PREFIX, free_bytes, remove_if_abandoned, remove_tree
from .locks import KeyLock, lock_is_held
from .safety import VaultError, make_private_dir
from .manifest import ManifestError, last_used, read_manifest
from .content_hash import MEMO_NAME
from .provisional import is_provisional, is_resumable, never_resumed
from .verification import DAMAGE_NAME, read_damage

__all__ = [
    "ROOT_ENV",
    "CACHE_DIR",
    "Combination",
    "default_cache_root",
    "cache_dir",
    "is_key",
    "lock_path",
    "use_path",
    "scan_combination",
    "list_combinations",
    "remove_if_unused",
    "is_in_use",
    "evict_lru",
    "resolve_key",
    "cache_bytes",
    "sweep_dead_temporaries",
]

CACHE_DIR = "lora_merge_cache"
ROOT_ENV = "HOSTMEM_CACHE_ROOT"  # the default root, where set


def default_cache_root() -> str:
    """``$HOSTMEM_CACHE_ROOT`` if set, else ``$XDG_CACHE_HOME/hostmem`` (an absolute one, as
    the XDG spec asks), else ``~/.cache/hostmem``; whichever it is, its whole path is
    checked as any root's is (:mod:`.path_walk`). A ``$HOSTMEM_CACHE_ROOT`` that is empty
    or relative (``~`` expanded first), or names a folder through a process (under
    ``/proc`` or ``/dev/fd``: ``/proc/self/cwd/x``) is refused: each process would resolve
    it against its own current folder, and a build and a server started from two folders
    would use two roots."""
    given = os.environ.get(ROOT_ENV)
    if given is not None:
        if not given.strip():
            raise InputError(f"{ROOT_ENV} is set but empty; give an absolute path (or unset it for the default, "
                             "$XDG_CACHE_HOME/hostmem, else ~/.cache/hostmem)")
        if not os.path.isabs(os.path.expanduser(given)):
            raise InputError(f"{ROOT_ENV}={given!r} is a relative path, which each process would resolve against "
                             f"its own current folder (here: {os.path.abspath(os.path.expanduser(given))!r}); give an absolute path")
        expanded = os.path.normpath(os.path.expanduser(given))
        if expanded == "/proc" or expanded.startswith(("/proc/", "/dev/fd/")):
            raise InputError(f"{ROOT_ENV}={given!r} is under {'/proc' if expanded.startswith('/proc') else '/dev/fd'}, "
                             "which names a folder through a process (its current folder, a descriptor): each process "
                             "would resolve it to its own; give an absolute path to the folder itself")
        return given
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    cache_home = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache_home, "hostmem")


def cache_dir(root: str) -> str:
    """``<root>/lora_merge_cache``, created 0700 when missing."""
    path = os.path.join(root, CACHE_DIR)
    make_private_dir(path)
    return path


def is_key(name: str) -> bool:
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)


def lock_path(cache: str, key: str) -> str:
    """The key's exclusive lock: held by a session while it builds, adopts or serves gets."""
    return os.path.join(cache, f"{key}.lock")


def use_path(cache: str, key: str) -> str:
    """The key's use lock: held shared for as long as weights served from it live."""
    return os.path.join(cache, f"{key}.use")


@dataclass
class Combination:
    """What ``hostmem cache ls`` shows of one combination (read without its lock)."""

    key: str
    path: str
    bytes: int = 0
    files: int = 0
    layers: int = 0
    created: float | None = None
    last_used: float = 0.0
    sealed: bool = False  # a manifest is there
    complete: bool = False
    in_use: bool = False
    inputs: dict = field(default_factory=dict)
    problem: str | None = None
    provisional: bool = False  # built while its base was hashed, not re-keyed (see provisional)

    @property
    def state(self) -> str:
        if self.in_use:
            return "in use"
        if self.provisional:
            return "provisional"
        if self.problem:
            return "damaged"
        return "complete" if self.sealed and self.complete else "partial"

    def to_dict(self) -> dict:
        return {
            "key": self.key,
            "path": self.path,
            "bytes": self.bytes,
            "files": self.files,
            "layers": self.layers,
            "created": self.created,
            "last_used": self.last_used,
            "state": self.state,
            "complete": self.complete,
            "inputs": self.inputs,
            "problem": self.problem,
        }


def _folder_bytes(path: str) -> tuple[int, int, float]:
    """Apparent bytes and count of the regular files in a folder, and its mtime. Read
    without the key's lock, while other processes may be writing there: a file gone
    between the listing and its stat (a layer's temporary file renamed as it is sealed)
    is not counted."""
    total = count = 0
    fd = open_folder(path)  # walked from the root's descriptor: a link on the way is refused, never listed
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
                    count += 1
        return total, count, os.fstat(fd).st_mtime
    finally:
        os.close(fd)


def scan_combination(cache: str, key: str) -> Combination:
    """Describe one combination folder; never raises over a damaged one (says so)."""
    path = os.path.join(cache, key)
    combo = Combination(key=key, path=path, in_use=is_in_use(cache, key), provisional=is_provisional(path))
    try:
        combo.bytes, combo.files, combo.last_used = _folder_bytes(path)
        manifest = read_manifest(path)
    except (OSError, ManifestError, VaultError) as exc:
        combo.problem = str(exc)
        return combo
    damage = read_damage(path)
    if damage:
        combo.problem = f"{'; '.join(damage[:3])} (recorded in {DAMAGE_NAME})"
    if manifest is not None:
        combo.sealed = True
        combo.layers = len(manifest.layers)
        combo.created, combo.last_used = manifest.created, last_used(path, manifest)
        combo.complete = manifest.complete
        combo.inputs = manifest.inputs
    else:
        try:
            names = listdir_in(path)
        except OSError as exc:
            names = []
            combo.problem = str(exc)
        combo.layers = sum(1 for n in names if n.endswith(".safetensors") and not n.startswith(TMP_PREFIX))
    return combo


def list_combinations(cache: str) -> list[Combination]:
    """Every combination folder under the cache, least recently used first."""
    combos = []
    for name in sorted(listdir_in(cache)):
        full = os.path.join(cache, name)
        if is_key(name) and (os.path.isdir(full) or os.path.islink(full)):
            combo = scan_combination(cache, name)
            if combo.problem is None or os.path.lexists(full):  # not one removed since the listing
                combos.append(combo)
    combos.sort(key=lambda c: c.last_used)
    return combos


def is_in_use(cache: str, key: str) -> bool:
    """True when a session holds the key's lock or served weights hold its use lock.

    A query: it creates, removes and keeps nothing (``hostmem cache ls`` changes no file).
    """
    try:
        session = lock_is_held(lock_path(cache, key), shared_too=False)
        return session or lock_is_held(use_path(cache, key), shared_too=True)
    except OSError:
        return False


def remove_if_unused(cache: str, key: str) -> bool:
    """Remove a combination unless it is in use (see :func:`is_in_use`); True when removed."""
    lock = KeyLock(lock_path(cache, key))
    if not lock.acquire(blocking=False):
        return False
    try:
        use = KeyLock(use_path(cache, key))
        if os.path.lexists(use.path) and not use.acquire(blocking=False):
            return False
        remove_tree(os.path.join(cache, key))
        use.release(remove=True)  # while held: nobody can be leasing it (that takes the key's lock)
    finally:
        lock.release(remove=True)
    return True


def resolve_key(cache: str, prefix: str) -> str:
    """The full key a (unique) prefix names, as ``hostmem cache rm`` accepts it."""
    prefix = prefix.strip().lower()
    if not prefix:
        raise VaultError(f"{cache}: an empty key names no combination; give a key (or its first characters) "
                         "as `hostmem cache ls` shows it")
    matches = [n for n in listdir_in(cache) if is_key(n) and n.startswith(prefix)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise VaultError(f"{cache}: no combination whose key starts with {prefix!r}; `hostmem cache ls` lists them")
    raise VaultError(f"{cache}: {len(matches)} combinations start with {prefix!r}; give more of the key")


def evict_lru(cache: str, keep: str, needed: int, max_size: int | None, headroom: int) -> list[Combination]:
    """Remove least-recently-used unused combinations so that ``needed`` more bytes fit.

    They fit when the cache's total stays within ``max_size`` and the disk keeps
    ``headroom`` free. ``keep`` (the key being opened) and combinations in use stay.
    When even removing every unused one would not make room, none is removed: losing
    a good combination for a build that cannot be stored anyway helps nobody.
    """
    total, free = cache_bytes(cache), free_bytes(cache)

    def fits(freed: int) -> bool:
        within = max_size is None or total - freed + needed <= max_size
        return within and free + freed >= needed + headroom

    if fits(0):
        return []  # the usual open (a hit needs nothing): no manifest of another combination is read
    candidates = [c for c in list_combinations(cache) if c.key != keep and not c.in_use]
    plan, freed = [], 0
    for combo in candidates:
        if fits(freed):
            break
        plan.append(combo)
        freed += combo.bytes
    if not plan or not fits(freed):
        return []
    return [c for c in plan if remove_if_unused(cache, c.key)]


def cache_bytes(cache: str, exclude: str | None = None) -> int:
    """Apparent bytes of every combination but ``exclude``."""
    total = 0
    for name in listdir_in(cache):
        full = os.path.join(cache, name)
        if is_key(name) and name != exclude and os.path.isdir(full) and not os.path.islink(full):
            try:
                total += _folder_bytes(full)[0]
            except FileNotFoundError:  # removed since the listing (evicted, dropped, pruned)
                continue
            except PermissionError:  # a folder this user may not read: its disk is in free_bytes' figure
                continue
    return total


# A small file's temporary (a memo, the kernel wisdom) as durable_write names it: at the
# root, beside files that are not the cache's, only these are taken for our leftovers.
_ROOT_TMP = re.compile(re.escape(TMP_PREFIX) + r"[0-9]+-[0-9a-f]{8}")


def _sweep_folder(folder: str, name_is=None) -> int:
    """Remove the temporary files in ``folder`` that no writer holds; how many went."""
    found = [os.path.join(folder, name) for name in listdir_in(folder)
             if name.startswith(TMP_PREFIX) and (name_is is None or name_is(name))]
    return sum(remove_if_abandoned(path) for path in found)


def sweep_dead_temporaries(cache: str) -> int:
    """Remove the temporary files of writers that died, anywhere under the cache.

    A writer is alive while it holds its temporary file's lock (see
    :mod:`hostmem.vault.durable`), which the kernel keeps across pid namespaces and
    drops when the writer dies; the pid in the name decides nothing. A combination
    folder whose key lock is held is not even looked into: its session is writing
    there. Other folders (a provider's records, such as ``conversions/``) are swept the
    same way, and a provisional combination whose key lock nobody holds goes whole (its
    builder died before it was re-keyed), unless it was left resumable
    (:mod:`.provisional`). The root above the cache holds the memos written beside it
    (``kernel_wisdom.json``): their writers' temporaries go too. Returns how many files went.
    """
    removed = _sweep_folder(cache) + _sweep_folder(os.path.dirname(cache), _ROOT_TMP.fullmatch)
    for name in listdir_in(cache):
        folder = os.path.join(cache, name)
        if not os.path.isdir(folder) or os.path.islink(folder):
            continue
        try:
            held = is_key(name) and lock_is_held(lock_path(cache, name), shared_too=False)
        except OSError:  # a lock that is a link or unreadable: not ours to judge; left for a person
            continue
        if not held:
            try:
                removed += _sweep_folder(folder)
            except PermissionError:  # a folder this user may not read: not ours to sweep; left for a person
                continue
            if is_key(name) and is_provisional(folder) and (  # its builder died
                    not is_resumable(folder) or never_resumed(folder, os.path.join(cache, MEMO_NAME))):
                remove_if_unused(cache, name)
    return removed
