"""Provisional combinations: built while their base is still being hashed.

A build on a base whose digests are not known yet runs under a provisional key while
the base is hashed beside it (:mod:`hostmem.vault.fold`), and is re-keyed to its real
key once the digests are known (:mod:`hostmem.vault.rekey`). Its folder carries a
marker file, ``provisional.json``, from the moment it is opened until the re-keyed
folder is in its final place; a folder with the marker is never served, wherever it is
and whatever its manifest says:

- adoption drops it (a writable root) or does not serve it (a read-only one), but for
  the one resumable case (:func:`is_resumable`: a build that failed or was interrupted,
  taken up by a build with the very same provisional key);
- the dead-writer sweep removes it once no process holds its key's lock (its builder
  died: the next start hashes or folds again), unless it is resumable and some start
  may still resume it (:func:`never_resumed`);
- ``hostmem cache ls`` shows it as ``provisional`` and ``hostmem cache prune`` removes it
  unless it is in use.

Kept apart from the re-keying so that the modules below it (adoption, combinations,
admin) can ask whether a folder is provisional without importing the build's machinery.
"""

from __future__ import annotations

import json
import os

from .durable import discard, durable_write, fsync_dir

__all__ = ["MARKER_NAME", "is_provisional", "is_resumable", "mark_provisional", "unmark_provisional",
           "PROVISIONAL_WHY", "never_resumed"]

MARKER_NAME = "provisional.json"
PROVISIONAL_WHY = "a provisional build (made while its base was being hashed, never re-keyed: its builder stopped)"


def _marker(folder: str) -> dict:
    from .safety import parse_json, read_trusted  # here: safety builds on the modules this one is beside

    try:
        data = parse_json(read_trusted(os.path.join(folder, MARKER_NAME)))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def is_provisional(folder: str) -> bool:
    """Whether ``folder`` is a provisional combination (it holds the marker)."""
    return os.path.lexists(os.path.join(folder, MARKER_NAME))


def is_resumable(folder: str) -> bool:
    """A provisional folder its builder left on purpose (the build failed or was
    interrupted, its layers sealed): only a build under the same provisional key (the
    same inputs, the base's shards with the same stamps) takes it up again; the
    dead-writer sweep leaves it, ``prune`` removes it."""
    marker = _marker(folder)
    return bool(marker.get("resumable")) and marker.get("provisional_key") == os.path.basename(folder)


def mark_provisional(folder: str, key: str, base_paths: list[str], resumable: bool = False) -> None:
    """Mark ``folder`` provisional, durably, before any layer is written into it (and, as
    ``resumable``, when its build stops before the re-key)."""
    text = json.dumps({"provisional_key": key, "base": base_paths, "resumable": resumable,
                       "why": "built while its base was being hashed; re-keyed once the digests are known"}, indent=1)
    durable_write(os.path.join(folder, MARKER_NAME), text.encode())


def unmark_provisional(folder: str) -> None:
    """The last step of a re-key: the folder, now under its real key, may be served."""
    discard(os.path.join(folder, MARKER_NAME))
    fsync_dir(folder)


def never_resumed(folder: str, memo_file: str) -> bool:
    """A resumable folder no start will take up again: a start builds under a provisional
    key only while its base's digests are not known, and the memo knows every shard the
    marker names at the stamp it has now (or a shard is gone). Its builder died: the
    dead-writer sweep removes it, as it removes any other provisional folder."""
    from .content_hash import load_memo_file, stamp_of  # here: only a sweep that found one asks

    paths = _marker(folder).get("base")
    if not isinstance(paths, list) or not paths:
        return False
    known = load_memo_file(memo_file)
    for path in paths:
        try:
            stamp = stamp_of(os.stat(str(path)))
        except OSError:
            return True  # a shard gone: no start has that base
        entry = known.get(f"{stamp[0]}:{stamp[1]}")
        if entry is None or list(entry[0]) != stamp:
            return False  # still to be hashed: the next start on it folds, and resumes this
    return True
