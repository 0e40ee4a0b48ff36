"""Verified adoption: a layer file is served only once its bytes match its checksum.

A layer file whose data changed (a bad block, a stray write, a file swapped behind the
cache's back) still has the size and header it was sealed with, so only its content
checksum can tell; a server that skipped it would draw wrong images and say nothing.
Reading every layer at every start would cost the whole cache's bytes, though, so a
verification is memoised the way content digests are (:mod:`.content_hash`): by the
file's (device, inode, size, mtime_ns, ctime_ns), with the checksum it matched. A file
this build wrote, or one verified once and unchanged since, is not read again; a new
or changed one (copied in, unpacked from an image, written to) is verified first.

The memo lives in this process, in each layer's record in the sealed manifest (the
stamp the file had when its bytes last matched: a start that finds every file with its
recorded stamp reads nothing else) and, where the combination's folder is writable, in
``<key>/verified.json``. ``hostmem cache verify`` reads every byte whatever the memo
says, and records what it finds damaged in ``<key>/damage.json`` (as does a reader that
finds a sealed layer's file not what its manifest says, :mod:`.readers`): while that file
is there no start trusts the memo for that combination, so the damaged layers are found
again, removed and rebuilt; the session that has rebuilt them removes the record.
"""

from __future__ import annotations

import json
import os
import threading

from .content_hash import stamp_of
from .durable import discard, durable_write
from .layer_file import LayerEntry, data_crc32, layer_problem
from .anchor import FolderFd
from .safety import parse_json, read_trusted

__all__ = ["VERIFIED_NAME", "DAMAGE_NAME", "VerifiedMemo", "check_layers", "read_damage", "record_damage"]

VERIFIED_NAME = "verified.json"
DAMAGE_NAME = "damage.json"
_PROCESS: dict[str, tuple[list[int], str]] = {}  # "dev:ino" -> (stamp, crc32) verified in this process
_PROCESS_LOCK = threading.Lock()


def _ident(stamp: list[int]) -> str:
    return f"{stamp[0]}:{stamp[1]}"


class VerifiedMemo:
    """What is known verified in one combination folder: the layer's own record (the
    stamp its manifest entry carries), this process's memo, and ``verified.json``, read
    only when the first two do not vouch for a file."""

    def __init__(self, folder: str, trust: bool = True):
        self.folder = folder
        self.dir = FolderFd(folder)  # the key folder's descriptor: each file stat'ed in it, no link followed
        self._trust = trust
        self._disk_memo: dict[str, tuple[list[int], str]] | None = None if trust else {}
        self._seen: dict[str, list[int]] = {}  # file -> its stamp, as vouched for or recorded in this session
        self.reread = 0  # files read to verify them in this session

    @property
    def _disk(self) -> dict[str, tuple[list[int], str]]:
        if self._disk_memo is None:
            self._disk_memo = _load(os.path.join(self.folder, VERIFIED_NAME))
        return self._disk_memo

    def holds(self, entry: LayerEntry) -> bool:
        """True when ``entry``'s file is unchanged since it was written or verified."""
        if not self._trust:
            return False
        try:
            stamp = stamp_of(self._lstat(entry.file))
        except OSError:
            return False
        if not self._known(entry, stamp):
            return False
        self._seen[entry.file] = stamp
        return True

    def _lstat(self, file: str) -> os.stat_result:
        return self.dir.run(lambda fd: os.stat(file, dir_fd=fd, follow_symlinks=False))

    def _known(self, entry: LayerEntry, stamp: list[int]) -> bool:
        """``stamp`` is one at which ``entry``'s bytes matched its checksum."""
        if entry.stamp is not None and list(entry.stamp) == stamp:
            return True  # the manifest's own record: written by the session that wrote or verified it
        with _PROCESS_LOCK:
            known = _PROCESS.get(_ident(stamp))
        if known is None:
            known = self._disk.get(entry.file)
        return known is not None and list(known[0]) == stamp and known[1] == entry.crc32

    def stamp_now(self, file: str) -> list[int] | None:
        """The stamp ``file`` has now, or None where it cannot be stat'ed."""
        try:
            return stamp_of(self._lstat(file))
        except OSError:
            return None

    def record(self, entry: LayerEntry, stamp: list[int] | None = None) -> LayerEntry:
        """``entry``'s file matches its checksum at ``stamp`` (default: now, for a file just
        written); return the entry with its stamp (where the file cannot be stat'ed, as it was)."""
        stamp = stamp if stamp is not None else self.stamp_now(entry.file)
        if stamp is None:
            return entry
        with _PROCESS_LOCK:
            _PROCESS[_ident(stamp)] = (stamp, entry.crc32)
        self._disk[entry.file] = (stamp, entry.crc32)
        self._seen[entry.file] = stamp
        return entry.with_stamp(stamp)

    def stamped(self, entry: LayerEntry) -> LayerEntry:
        """``entry`` with the stamp this session vouched for or recorded (no file is read)."""
        stamp = self._seen.get(entry.file)
        return entry if stamp is None or entry.stamp == tuple(stamp) else entry.with_stamp(stamp)

    def save(self, entries: dict[str, LayerEntry]) -> None:
        """Keep the memo of ``entries`` on disk (a hint: where it cannot be written, it is not)."""
        files = {e.file: e for e in entries.values()}
        known = {f: (s, c) for f, (s, c) in self._disk.items() if f in files}
        known.update((f, (s, files[f].crc32)) for f, s in self._seen.items() if f in files)
        data = {f: {"stamp": s, "crc32": c} for f, (s, c) in known.items()}
        try:
            durable_write(os.path.join(self.folder, VERIFIED_NAME), json.dumps(data).encode())
        except OSError:
            pass


def _load(path: str) -> dict[str, tuple[list[int], str]]:
    try:
        data = parse_json(read_trusted(path))
        return {f: (list(e["stamp"]), str(e["crc32"])) for f, e in data.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _problem(folder: str, entry: LayerEntry) -> str | None:
    """Why ``entry``'s file is not the layer it was sealed as: header, size, or content."""
    problem = layer_problem(folder, entry)
    if problem is None:
        found = data_crc32(os.path.join(folder, entry.file))
        if found != entry.crc32:
            problem = (
                f"{os.path.join(folder, entry.file)}: content checksum {found} differs from the recorded "
                f"{entry.crc32} (layer {entry.name!r})"
            )
    return problem


def _threads() -> int:
    try:
        return max(1, min(8, len(os.sched_getaffinity(0))))
    except AttributeError:
        return 1


def check_layers(folder: str, entries: dict[str, LayerEntry], memo: VerifiedMemo) -> dict[str, str]:
    """Verify every entry the memo does not vouch for, a few files at a time.

    Returns the problems by tensor name; entries that pass are recorded in ``memo``.
    """
    todo = [e for e in entries.values() if not memo.holds(e)]
    if not todo:
        return {}
    from concurrent.futures import ThreadPoolExecutor  # not at import: `hostmem cache` starts light

    def checked(entry: LayerEntry) -> tuple[str | None, list[int] | None]:
        """The problem, and the stamp the file had when its read began: what a pass vouches
        for. One that changed while it was read (a write behind the read) vouches for nothing."""
        before = memo.stamp_now(entry.file)
        problem = _problem(folder, entry)
        if problem is None and (before is None or memo.stamp_now(entry.file) != before):
            problem = f"{os.path.join(folder, entry.file)}: changed while it was verified (layer {entry.name!r})"
        return problem, before

    with ThreadPoolExecutor(min(_threads(), len(todo)), "hostmem-vault-verify") as pool:
        results = list(pool.map(checked, todo))
    memo.reread += len(todo)
    failed = {}
    for entry, (problem, stamp) in zip(todo, results):
        if problem:
            failed[entry.name] = problem
        else:
            memo.record(entry, stamp)
    return failed


def read_damage(folder: str) -> list[str] | None:
    """The problems recorded for this folder (by `hostmem cache verify`, or a reader that
    could not map a layer), or None."""
    try:
        data = parse_json(read_trusted(os.path.join(folder, DAMAGE_NAME)))
        return [str(p) for p in data.get("problems", [])] or ["recorded as damaged"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError, TypeError):
        return ["recorded as damaged (its record is unreadable)"]


def record_damage(folder: str, problems: list[str]) -> None:
    """Record ``problems`` (or, with none, clear the record)."""
    path = os.path.join(folder, DAMAGE_NAME)
    if problems:
        durable_write(path, json.dumps({"problems": problems}, indent=1).encode())
    else:
        discard(path)
