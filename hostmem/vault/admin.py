"""Looking after a cache root by hand: list, verify, prune, remove (``hostmem cache``).

These never wait for a lock: a combination some process is building is reported as
"in use" and left alone. ``ls`` is a query: it leaves every file as it found it.
``verify`` reads every byte of every layer whatever the verification memo says, and
keeps its word: what it finds damaged is recorded in the combination
(``damage.json``), so that ``ls`` shows it damaged, ``prune`` removes it, and no start
trusts that combination's memo until every layer has been checked again and the bad
ones rebuilt. ``prune`` removes damaged and partial combinations and the temporary
files of writers that died, anywhere under the root; :func:`prune_records` then the
providers' records that no combination left needs (:mod:`.records`).
"""

from __future__ import annotations

import os
import stat
import sys
from dataclasses import dataclass, field

from .anchor import listdir_in, lstat_in, unlink_in
from .durable import TMP_PREFIX
from .layer_file import data_crc32, is_layer_file_name, layer_problem, read_layer_file
from .locks import KeyLock, describe_holders, held_by_others, lock_holders, lock_is_held
from .manifest import MANIFEST_NAME, ManifestError, read_manifest
from .provisional import MARKER_NAME, PROVISIONAL_WHY
from .records import StaleRecord, stale_records
from .safety import VaultError, check_folder_safe, prepare_root, root_is_read_only
from .verification import DAMAGE_NAME, VERIFIED_NAME, record_damage
from .combinations import (
    CACHE_DIR,
    Combination,
    is_key,
    list_combinations,
    lock_path,
    remove_if_unused,
    resolve_key,
    scan_combination,
    sweep_dead_temporaries,
    use_path,
)

__all__ = ["existing_cache_dir", "VerifyReport", "verify_combination", "verify_all", "prune", "prune_records",
           "remove"]


def say(message: str) -> None:
    """One line to stderr, as the vault's sessions say things (without importing torch)."""
    print(f"hostmem: {message}", file=sys.stderr, flush=True)


def existing_cache_dir(root: str) -> str | None:
    """``<root>/lora_merge_cache`` if it exists (after the root's safety checks), else None.

    Listing a root that was never used must not create it.
    """
    root = os.path.abspath(os.path.expanduser(root))
    try:
        found = os.stat(os.path.join(root, CACHE_DIR))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except PermissionError:  # a root this user may not search: not "nothing cached", which it may hold
        prepare_root(root, create=False)  # refuses it by name, as a start does
        raise VaultError(f"{root}: this user may not look into it (permission denied): `chmod u+rwx {root}` "
                         "if it is this user's, or choose another cache root")
    if not stat.S_ISDIR(found.st_mode):
        return None
    return os.path.join(prepare_root(root, create=False), CACHE_DIR)


@dataclass
class VerifyReport:
    """The outcome of checking one combination's every byte."""

    key: str
    state: str  # ok | bad | in use
    layers: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    inputs_changed: int = 0  # of the problems, inputs changed below the filesystem (the layers are right)

    def to_dict(self) -> dict:
        return {
            "key": self.key,
            "state": self.state,
            "layers": self.layers,
            "bytes": self.bytes,
            "problems": self.problems,
            "notes": self.notes,
            "inputs_changed": self.inputs_changed,
        }


def _verify_files(folder: str, report: VerifyReport) -> None:
    """Check the manifest's layers (size, header, checksum) and flag files it does not know."""
    try:
        manifest = read_manifest(folder)
    except (ManifestError, VaultError) as exc:
        report.problems.append(str(exc))
        return
    if manifest is None:
        report.notes.append(f"{folder}: no {MANIFEST_NAME} yet (an interrupted build; the next start resumes it)")
        entries = {}
    else:
        entries = {e.file: e for e in manifest.layers.values()}
    for name in sorted(listdir_in(folder)):
        if name in (MANIFEST_NAME, VERIFIED_NAME, DAMAGE_NAME, MARKER_NAME):
            continue
        path = os.path.join(folder, name)
        try:
            found = lstat_in(path)  # in the key folder's descriptor, walked from the root's
        except FileNotFoundError:
            continue  # gone since the listing (a writer's temporary renamed)
        if stat.S_ISLNK(found.st_mode):
            report.problems.append(f"{path}: a symlink (the cache refuses them)")
        elif name.startswith(TMP_PREFIX):  # never a layer: no damage of the combination's
            report.notes.append(f"{path}: leftover temporary file of a writer that died (the next build here "
                                "removes it)")
        elif name in entries:
            continue
        elif is_layer_file_name(name):  # sealed by a session that died before its manifest
            _check_layer(folder, _self_described(path, report), report)
        else:
            report.problems.append(f"{path}: a file the cache did not write")
    for entry in entries.values():
        _check_layer(folder, entry, report)


def _self_described(path: str, report: VerifyReport):
    try:
        return read_layer_file(path)
    except (ValueError, OSError) as exc:
        report.problems.append(str(exc))
        return None


def _check_layer(folder: str, entry, report: VerifyReport) -> None:
    if entry is None:
        return
    problem = layer_problem(folder, entry)
    path = os.path.join(folder, entry.file)
    if problem is None and data_crc32(path) != entry.crc32:
        problem = f"{path}: content checksum differs from the recorded one (layer {entry.name!r})"
    if problem:
        report.problems.append(problem)
    else:
        report.layers += 1
        report.bytes += entry.size


def verify_combination(cache: str, key: str) -> VerifyReport:
    """Check every byte of one combination, under a shared lock taken without waiting,
    and record what is damaged (or clear an old record when nothing is).

    The lock file is left as it was found (one it had to create goes again). On a
    read-only root nobody can be building, so there is no lock to take, and nothing is
    recorded: the report is all there is. A combination gone since it was listed is
    reported ``gone``; a folder or lock the cache may not trust (a link, another user's)
    is reported ``bad`` and nothing is written through it.
    """
    report = VerifyReport(key, "ok")
    folder = os.path.join(cache, key)
    try:
        check_folder_safe(folder)
    except FileNotFoundError:
        return VerifyReport(key, "gone", notes=[f"{folder}: removed since it was listed (evicted or pruned)"])
    except VaultError as refused:
        return VerifyReport(key, "bad", problems=[str(refused)])
    try:
        if root_is_read_only(cache):
            _verify_files(folder, report)
        else:
            _verify_locked(cache, key, folder, report)
    except FileNotFoundError:
        return VerifyReport(key, "gone", notes=[f"{folder}: removed while it was being checked"])
    except VaultError as refused:
        report.problems.append(str(refused))
    if report.problems and report.state == "ok":
        report.state = "bad"
    return report


def _shares_building(cache: str, key: str) -> bool:
    """Whether a share of a shared build is writing ``key`` (its ``<key>.lock.<i>of<n>`` held:
    a share holds the key's lock shared, as a verify does, so that lock cannot tell)."""
    prefix = os.path.basename(lock_path(cache, key)) + "."
    return any(lock_is_held(os.path.join(cache, name), shared_too=True)
               for name in listdir_in(cache) if name.startswith(prefix) and "of" in name)


def _verify_locked(cache: str, key: str, folder: str, report: VerifyReport) -> None:
    lock = KeyLock(lock_path(cache, key))
    existed = os.path.lexists(lock.path)
    if not lock.acquire(exclusive=False, blocking=False):
        report.state = "in use"
        return
    try:
        if _shares_building(cache, key):  # one opening after this writes temporaries (notes) and sealed layers
            report.state = "in use"
            return
        _verify_files(folder, report)
        record_damage(folder, report.problems)  # kept, so no start trusts what failed here
    finally:
        if existed:
            lock.release()
        else:
            lock.release_and_remove_if_alone()


def verify_all(cache: str, keys: list[str] | None = None, deep: bool = False) -> list[VerifyReport]:
    """Verify the named combinations (key prefixes), or all of them; ``deep`` also reads
    every input they record again and compares it with their key (:mod:`.deep`)."""
    names = [resolve_key(cache, k) for k in keys] if keys else [c.key for c in list_combinations(cache)]
    reports, read = [], {}
    for key in names:
        report = verify_combination(cache, key)
        if deep and report.state in ("ok", "bad"):
            _verify_inputs(cache, key, report, read)
        reports.append(report)
    return reports


def _verify_inputs(cache: str, key: str, report: VerifyReport, read: dict) -> None:
    """Re-hash the inputs ``key``'s manifest records (not recorded as damage: the layers
    are the right merge of what the key names; the memo entry of a changed input goes)."""
    from .content_hash import MEMO_NAME
    from .deep import deep_check  # here: a plain verify reads no input

    try:
        manifest = read_manifest(os.path.join(cache, key))
    except (ManifestError, VaultError, OSError):
        return  # already reported as a problem of the combination
    if manifest is None:
        return
    memo = None if root_is_read_only(cache) else os.path.join(cache, MEMO_NAME)
    problems, notes = deep_check(manifest.inputs, memo, read, key)
    report.problems += problems
    report.notes += notes
    report.inputs_changed = len(problems)
    if problems:
        report.state = "bad"


def _prune_reason(combo: Combination, everything: bool, held_too: bool = False) -> str | None:
    """Why a prune removes ``combo``, or None; ``held_too``: as if nothing held it."""
    if combo.in_use and not held_too:
        return None
    if everything:
        return "all"
    if combo.provisional:
        return PROVISIONAL_WHY
    if combo.problem:
        return f"damaged: {combo.problem}"
    if not combo.sealed:
        return "partial: an interrupted build"
    if not combo.complete:
        return "partial: a build that stopped before its last layer"
    return None


def prune(cache: str, max_size: int | None = None, everything: bool = False, dry_run: bool = False) -> list[tuple[Combination, str]]:
    """Remove unused combinations that are damaged or partial, then (with
    ``max_size``) least-recently-used ones until the cache fits; ``everything`` removes
    every unused one. Also clears temporary files and locks nobody holds.
    Returns what was (or, with ``dry_run``, would be) removed, with the reason."""
    combos = list_combinations(cache)
    chosen = [(c, r) for c in combos if (r := _prune_reason(c, everything))]
    for combo in combos:  # what it would remove but for a holder: named, never silently skipped
        if combo.in_use and _prune_reason(combo, everything, held_too=True):
            say(f"left {combo.key[:12]} alone: in use ({_held_words(cache, combo.key)})")
    total = sum(c.bytes for c in combos) - sum(c.bytes for c, _ in chosen)
    for combo in combos:
        if max_size is None or total <= max_size:
            break
        if not combo.in_use and all(combo is not c for c, _ in chosen):
            chosen.append((combo, f"least recently used beyond {max_size} bytes"))
            total -= combo.bytes
    if dry_run:
        return chosen
    removed = [(c, r) for c, r in chosen if _removed(cache, c.key)]
    _clear_strays(cache)
    return removed


def _removed(cache: str, key: str) -> bool:
    """Remove one unused combination; one the cache may not touch (a lock file of another
    user's, a link) is named and left, and the prune goes on."""
    try:
        return remove_if_unused(cache, key)
    except (VaultError, OSError) as exc:
        say(f"left {key[:12]} alone: {exc}")
        return False


def prune_records(cache: str, gone: set[str] = frozenset(), dry_run: bool = False) -> list[StaleRecord]:
    """Remove the providers' records that no combination under ``cache`` needs, the
    combinations keyed in ``gone`` counted as removed (what :func:`prune` removed, or with
    ``dry_run`` would remove). Returns what was (or would be) removed, with the reason."""
    stale = stale_records(cache, [c for c in list_combinations(cache) if c.key not in gone])
    if dry_run:
        return stale
    removed = []
    for record in stale:
        try:
            unlink_in(record.path)
        except FileNotFoundError:  # another prune was first
            continue
        removed.append(record)
    return removed


def _clear_strays(cache: str) -> None:
    """Temporary files of dead writers anywhere under the cache, and lock files of keys
    nobody holds.

    A ``.use`` file goes only while its key's lock is held too: a lease is taken under
    that lock, so none can start on a file that is about to disappear.
    """
    sweep_dead_temporaries(cache)
    for name in listdir_in(cache):
        key, _, suffix = name.rpartition(".")
        if suffix in ("lock", "use") and is_key(key):
            _clear_locks(cache, key)


def _clear_locks(cache: str, key: str) -> None:
    lock = KeyLock(lock_path(cache, key))
    try:
        if not lock.acquire(blocking=False):
            return
    except (VaultError, OSError) as exc:  # another user's lock file, or a link: named, left, and on to the next
        say(f"left the locks of {key[:12]} alone: {exc}")
        return
    try:
        use = KeyLock(use_path(cache, key))
        if os.path.lexists(use.path) and use.acquire(blocking=False):
            use.release(remove=True)
    finally:
        lock.release(remove=True)


def _holders(cache: str, key: str) -> list:
    return [h for path in (lock_path(cache, key), use_path(cache, key)) for h in lock_holders(path)]


def _held_words(cache: str, key: str) -> str:
    """Who holds a combination, and, where it is another user, what to do."""
    holders = _holders(cache, key)
    if held_by_others(holders):
        return (f"held by {describe_holders(holders)}, another user; make the cache root private (`chmod -R go-rwx "
                f"{os.path.dirname(cache)}`) or ask them to stop")
    return f"held by {describe_holders(holders)}" if holders else "a process builds it or serves weights from it"


def remove(cache: str, key_prefix: str) -> Combination:
    """Remove one combination (a unique key prefix will do); refuse one in use."""
    key = resolve_key(cache, key_prefix)
    combo = scan_combination(cache, key)
    if not remove_if_unused(cache, key):
        holders = _holders(cache, key)
        if held_by_others(holders):  # never work of this user's: no process of ours to stop
            raise VaultError(
                f"{combo.path}: its lock is held by {describe_holders(holders)}, another user, who can open "
                f"the cache's files; make the cache root private (`chmod -R go-rwx {os.path.dirname(cache)}`), "
                f"ask them to stop, or remove {lock_path(cache, key)} and {use_path(cache, key)}, then run this again"
            )
        raise VaultError(
            f"{combo.path}: in use (a process is building it, or serves weights from it: its lock "
            f"{lock_path(cache, key)} or {use_path(cache, key)} is held by {describe_holders(holders)}); stop "
            "that process or unmerge its model, then run this again"
        )
    return combo
