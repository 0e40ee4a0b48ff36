"""One folder of providers' records across the cache roots a start uses.

A provider's records (:mod:`hostmem.vault.records`) are JSON files named by what they
describe, in a folder of their kind under each root's cache folder. A start reads a
record from the first root that holds a valid one (a read-only root baked into an image
included: its records were written when its combinations were) and writes new ones into
the first writable root. A record is a hint: one that cannot be read (missing, damaged,
another version, another user's, a link) is no record, and one that cannot be written
is skipped, saying which file and why; the work it would have spared is done again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from .durable import durable_write, read_small
from .locks import say
from .safety import VaultError, check_folder_safe, make_private_dir, parse_json

__all__ = ["Shelf"]


class Shelf:
    """The records of one kind (``folder``, one of :data:`~hostmem.vault.records.RECORD_FOLDERS`)
    under the caches of ``vaults`` (:class:`~hostmem.vault.Vault`, in the start's order)."""

    def __init__(self, vaults: list, folder: str):
        self.vaults = list(vaults)
        self.folder = folder
        self.writable = next((v for v in self.vaults if not v.read_only), None)

    def load(self, name: str, valid: Callable[[object], bool]) -> dict | None:
        """The record ``name`` from the first root holding one that ``valid`` accepts, else None.
        The folder must be ours and private and the file a regular file of ours, never a link."""
        for vault in self.vaults:
            folder = os.path.join(vault.cache, self.folder)
            try:
                check_folder_safe(folder)
                record = parse_json(read_small(os.path.join(folder, f"{name}.json")))
            except (OSError, VaultError, ValueError):
                continue
            if valid(record):
                return record
        return None

    def store(self, name: str, record: dict) -> bool:
        """Write ``record`` as ``name`` into the first writable root, atomically; False where
        there is none or it cannot be written (a full disk, a refused folder)."""
        if self.writable is None:
            return False
        folder = os.path.join(self.writable.cache, self.folder)
        path = os.path.join(folder, f"{name}.json")
        try:
            make_private_dir(folder)
            durable_write(path, json.dumps(record, allow_nan=False).encode())
        except (OSError, VaultError, ValueError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            say(f"{path}: record not written ({why}); the next start does this work again")
            return False
        return True
