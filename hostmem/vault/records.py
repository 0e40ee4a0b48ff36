"""Providers' records beside the combinations, and which of them no combination needs.

A provider may keep small records under the cache, one JSON file per input it has
seen, that let a later start skip work on that input (the LoRA merge cache's
``conversions/``: what converting an adapter file produced, so that a start whose every
layer is cached plans without converting; ``rounding/``: which layers of a combination
lose their update to rounding, so that a start on a cached combination does not measure
them again). Each record names the content digest of the
input it describes (``"digest"``, as the combinations' manifests name their inputs).
A record only serves starts whose combination is cached, so once no combination left
under the cache names its digest, the record is dead weight: :func:`stale_records`
finds those (and records that name no digest, or cannot be read), and ``hostmem cache
prune`` removes them with the combinations. A record is a hint: one removed while it
was still wanted costs the next start that input's work again, and it is written anew.

A record younger than :data:`FRESH_SECONDS` is left alone: the combination it was
written for may be being built right now, without a manifest yet to name its inputs.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from .anchor import open_folder
from .combinations import Combination
from .durable import TMP_PREFIX
from .safety import check_folder_safe, parse_json, read_trusted

__all__ = ["CONVERSIONS", "ROUNDING", "RECORD_FOLDERS", "FRESH_SECONDS", "StaleRecord", "check_record_folders", "input_digests",
           "records_under", "stale_records"]

CONVERSIONS = "conversions"  # lora_cache.adapters.conversion_memo's
ROUNDING = "rounding"  # lora_cache.placement.rounding_memo's
RECORD_FOLDERS = (CONVERSIONS, ROUNDING)  # folders of records under the cache folder
FRESH_SECONDS = 3600
_LARGEST = 64 * 1024 * 1024  # a record larger than this is not one


@dataclass(frozen=True)
class StaleRecord:
    """A record no combination under the cache needs, and why."""

    path: str
    bytes: int
    reason: str


def input_digests(inputs: dict) -> set[str]:
    """Every content digest a combination's manifest inputs name (its base shards, its adapters)."""
    found: set[str] = set()

    def walk(value) -> None:
        if isinstance(value, dict):
            for field in ("digest", "file_digest"):  # file_digest: an adapter keyed by its meaning
                if isinstance(value.get(field), str):
                    found.add(value[field])
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(inputs)
    return found


def _why_stale(path: str, size: int, live: set[str]) -> str | None:
    if size > _LARGEST:
        return "not a record: too large"
    try:
        record = parse_json(read_trusted(path, _LARGEST))  # never a FIFO, a link, or another user's file
    except (OSError, ValueError):
        return "unreadable"
    digest = record.get("digest") if isinstance(record, dict) else None
    if not isinstance(digest, str):
        return "names no input (written by an older version)"
    if digest not in live:
        return f"no combination left uses its input ({digest[:19]})"
    return None


def check_record_folders(cache: str) -> list[str]:
    """The records folders under ``cache`` that are there, each checked to be a real folder
    of ours and private (never a link to someone else's files to remove);
    :class:`~hostmem.vault.safety.VaultError` names one that is not."""
    folders = [os.path.join(cache, name) for name in RECORD_FOLDERS]
    folders = [folder for folder in folders if os.path.lexists(folder)]
    for folder in folders:
        check_folder_safe(folder)
    return folders


def records_under(cache: str) -> list[tuple[str, os.stat_result]]:
    """Every record file under ``cache`` (its path and stat), by folder and name; a records
    folder that is a link, or not private and ours, raises
    :class:`~hostmem.vault.safety.VaultError` naming it."""
    found = []
    for folder in check_record_folders(cache):
        fd = open_folder(folder)  # walked from the root's descriptor: no link on the way followed
        try:
            for entry in sorted(os.scandir(fd), key=lambda e: e.name):
                if entry.name.startswith(TMP_PREFIX) or not entry.name.endswith(".json"):
                    continue  # writers' temporaries are the sweep's (it knows the live ones), not ours
                if entry.is_file(follow_symlinks=False):
                    found.append((os.path.join(folder, entry.name), entry.stat(follow_symlinks=False)))
        finally:
            os.close(fd)
    return found


def stale_records(cache: str, combos: list[Combination], now: float | None = None,
                  found: list[tuple[str, os.stat_result]] | None = None) -> list[StaleRecord]:
    """The records under ``cache`` (or of ``found``, what :func:`records_under` gave) that
    none of ``combos`` (the combinations that stay) names the input of, older than
    :data:`FRESH_SECONDS`. Reads, removes nothing; raises as :func:`records_under`."""
    live: set[str] = set()
    for combo in combos:
        live |= input_digests(combo.inputs)
    now = time.time() if now is None else now
    stale = []
    for path, stat in records_under(cache) if found is None else found:
        if now - stat.st_mtime >= FRESH_SECONDS and (reason := _why_stale(path, stat.st_size, live)) is not None:
            stale.append(StaleRecord(path, stat.st_size, reason))
    return stale
