"""``hostmem cache verify --deep``: every input of every combination read again, whole.

A start names its inputs by their content digests, memoised by each file's (device,
inode, size, mtime, ctime) (:mod:`.content_hash`), so that a 60 GB base is not read at
every start. That stamp is the filesystem's word. Below the filesystem it can be wrong:
a block device rewritten under a mounted filesystem (an image file changed while it is
loop-mounted, a disk written through its device node), or a network filesystem whose
server changes a file without changing the ctime its clients see. The bytes then
change and the stamp does not, and a start serves the merge of the old bytes.

``--deep`` reads each input file the combinations record, whole, and compares its
digest with the one its key was made from. An input whose bytes changed while its size
and mtime stayed those the manifest records is named (the exit status is 1); its entry
in the digest memo goes, so the next start hashes it again and builds the merge of what
it holds now. An input whose size or mtime differs was replaced the ordinary way (a new
version written or renamed over it): a start hashes it anew and misses, so that is a
note, not damage. Either way the combination itself is left: it is the right merge of
the bytes it records. An input that is not where it was recorded is noted, not checked.
"""

from __future__ import annotations

import os
import stat

from .content_hash import file_digest, forget_in_memo_file

__all__ = ["recorded_inputs", "deep_check"]


def recorded_inputs(inputs: dict) -> list[tuple[str, str, tuple | None]]:
    """``(path, digest, (size, mtime_ns) or None)`` of every input file a combination's
    manifest records: the base's shards, then the adapters; the stamp where the manifest
    records one. An adapter keyed by its meaning (the merge it means, read through its
    converter) records its file's own content digest as ``file_digest`` beside it: that is
    the one the file's bytes are compared with."""
    base = inputs.get("base") if isinstance(inputs, dict) else None
    files = list(base.get("shards") or []) if isinstance(base, dict) else []
    files += list(inputs.get("adapters") or []) if isinstance(inputs, dict) else []
    out = []
    for f in (f for f in files if isinstance(f, dict)):
        path, digest = f.get("path"), f.get("file_digest", f.get("digest"))
        stamp = (f.get("size"), f.get("mtime_ns"))
        if isinstance(path, str) and isinstance(digest, str):
            out.append((path, digest, stamp if all(type(v) is int for v in stamp) else None))
    return out


def deep_check(inputs: dict, memo_file: str | None, read: dict[str, str], key: str) -> tuple[list[str], list[str]]:
    """``(problems, notes)`` of re-hashing the inputs ``inputs`` records (of the combination
    ``key``); ``read`` holds the digests taken so far in this run (a base shared by many
    combinations is read once). Another digest under the recorded size and mtime is a
    problem; under another size or mtime, a note (the file was replaced)."""
    problems, notes = [], []
    for path, recorded, stamp in recorded_inputs(inputs):
        try:
            st = os.stat(path)
        except OSError:
            st = None
        if st is None or not stat.S_ISREG(st.st_mode):
            notes.append(f"{path}: not there any more; not checked")
            continue
        if path not in read:
            read[path] = file_digest(path)
        if read[path] == recorded:
            continue
        digests = f"digest now {read[path][:19]}, the key was made from {recorded[:19]}"
        if stamp is not None and stamp != (st.st_size, st.st_mtime_ns):
            notes.append(f"{path} was replaced since this combination was built ({digests}); it serves the bytes "
                         f"its key names; remove it with `hostmem cache rm {key[:12]}` if that version is no "
                         "longer used")
            continue
        if memo_file is not None:
            forget_in_memo_file(memo_file, path)
        problems.append(f"{path}: its bytes changed below the filesystem's notice ({digests}, under the size and "
                        "mtime it was recorded with); its memoised digest is dropped, so the next start hashes it "
                        "again and builds the merge of what it holds now")
    return problems, notes
