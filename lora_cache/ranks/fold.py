"""A shared build on a base not hashed yet: the ranks hash it while they build their shares.

A rank alone folds the base's content hash into its build (:mod:`hostmem.vault.fold`):
it builds under a provisional key while a thread hashes the base beside it. The ranks of
a shared build (:mod:`lora_cache.shared_build`) hashed the base first, together, and
only then built: on a 2-core host, four ranks hashing 1 GiB took about 0.2 s before any
share started, as long as a fifth of the rank alone's whole build. Folded, the same:

1. the adapters (small) are hashed first, split across the ranks as before, so that
   every rank can tell whether to fold (:func:`hostmem.vault.fold.plan_fold`: some base
   digest is not memoised, and no root holds a combination this may be once hashed),
   and the ranks fold only where every one of them would, with the same provisional
   key (the base shards' stamps: the same files on one host), and where hashing first
   would leave cores idle (:func:`fold_pays`);
2. the lowest rank marks the provisional folder before any share is written in it
   (:mod:`hostmem.vault.provisional`: never served), as resumable: a build a rank left
   (it died, or a share failed) is taken up by the next shared start on the same files;
3. each rank hashes its set of the base's shards (split by bytes, as the inputs were)
   on a thread beside its share, and hands its digests round at the meeting that ends
   the shares; a rank whose hash failed names the file, and every rank raises it;
4. every rank memoises the digests (the lowest rank on disk too), the lowest rank seals
   the provisional combination and re-keys it to its real key
   (:func:`hostmem.vault.rekey.rekey`), and ``merge`` opens the real key as usual,
   every rank mapping it under the lock held shared.

A base that changed while it was hashed fails the start on every rank, naming the file,
and what was built from it is removed.

Hashing first runs one file per rank at a time, each on one core. Where the files to
hash and the ranks both outnumber the cores, that already keeps every core busy, and
folding only adds a hash thread to every rank while the ranks' builds want the same
cores: measured with 4 ranks on 2 cores and a base of 4 shards (1 GiB), the shared
build took 1.49 s folded against 1.10 s hashing first. So the ranks fold only where
fewer files than cores, or fewer ranks than cores, are hashed (a host of 8 GPUs has
dozens of cores).
"""

from __future__ import annotations

import os
import threading

from hostmem.errors import InputError
from hostmem.host_ledger import gather_on_host
from hostmem.vault.content_hash import CONTENT_HASH_MEMO, file_digest
from hostmem.vault.durable import remove_tree
from hostmem.vault.fold import Fold, plan_fold
from hostmem.vault.identity import CacheKey, provisional_key
from hostmem.vault.provisional import mark_provisional
from hostmem.vault.rekey import rekey
from hostmem.vault.safety import make_private_dir

__all__ = ["SharedFold", "fold_pays", "plan_shared_fold"]


class SharedFold:
    """This rank's part of a folded shared build: the provisional key, the base's shards
    this rank hashes (:meth:`start`), and the real key once every rank's digests are in
    (:meth:`real_key`)."""

    def __init__(self, fold: Fold, index: int, count: int, split):
        self.fold, self.index = fold, index
        self.key: CacheKey = provisional_key(fold.inputs, [stamp for _, stamp, _ in fold.shards])
        missing = [path for path, _, known in fold.shards if known is None]
        self.mine = split(missing, count)[index]
        self._digests: dict[str, str] = {}
        self._error: str | None = None
        self._thread: threading.Thread | None = None

    @property
    def folder(self) -> str:
        return os.path.join(self.fold.writable.cache, self.key.hex)

    def mark(self) -> None:
        """The lowest rank, before any share is written: the folder is provisional (never
        served) and resumable (a build with the same provisional key takes it up)."""
        make_private_dir(self.folder)
        mark_provisional(self.folder, self.key.hex, self.fold.paths, resumable=True)

    def start(self) -> None:
        """Hash this rank's shards on a thread of their own, beside the share's build."""
        self._thread = threading.Thread(target=self._hash, name="hostmem-shared-fold-hash", daemon=True)
        self._thread.start()

    def _hash(self) -> None:
        try:
            for path in self.mine:
                self._digests[path] = file_digest(path)
        except OSError as exc:
            self._error = f"{path}: could not be read to hash it ({exc})"

    def hashed(self) -> dict:
        """What this rank hands round when its share is done: its digests, or its error."""
        if self._thread is not None:
            self._thread.join()
        return {"error": self._error} if self._error else {"digests": self._digests}

    def real_key(self, handed: list[dict]) -> CacheKey:
        """Every rank's :meth:`hashed` gathered: memoise the digests (the lowest rank on
        disk), and the real key. A hash that failed, or a shard changed while it was
        hashed, raises on every rank; the lowest rank removes what was built first."""
        digests = {path: known for path, _, known in self.fold.shards if known is not None}
        try:
            for found in handed:
                if found.get("error"):
                    raise InputError(f"the base could not be hashed for the LoRA merge cache key: {found['error']}")
                digests.update(found["digests"])
            memo_file = self.fold.writable.memo_file if self.index == 0 else None
            for path, stamp, known in self.fold.shards:
                if known is None:  # refused where the file changed since it was stat'ed
                    CONTENT_HASH_MEMO.record(path, list(stamp), digests[path], memo_file)
        except (ValueError, KeyError) as exc:
            if self.index == 0:
                remove_tree(self.folder)
            raise InputError(f"{exc}; nothing built from it was kept") from None
        return self.fold.real_key([digests[path] for path in self.fold.paths])

    def rekey_after_seal(self, real: CacheKey):
        """The seal's hook (its lock still held): name the sealed combination by ``real``."""
        return lambda session: rekey(session.vault, session.key, real, self.fold.vaults)


def fold_pays(files: int, ranks: int, cores: int) -> bool:
    """Whether hashing ``files`` first across ``ranks`` would leave some of ``cores`` idle (so
    that the build has cores to hash beside it): one file per rank at a time, one core each."""
    return 0 < min(files, ranks) < cores


def plan_shared_fold(vaults: list, shards: list[str], rest: tuple, index: int, count: int, split,
                     timeout: float) -> SharedFold | None:
    """This rank's :class:`SharedFold` when every rank of the host would fold with the same
    provisional key (a collective: every rank of the host calls it), else None (the
    ranks then hash the base first). ``rest``: the key's inputs besides the base, the
    adapters hashed already; ``split``: how files are shared out among the ranks. The
    host's cores are counted whole (``os.cpu_count``), not by this rank's affinity, so
    that every rank judges :func:`fold_pays` alike."""
    fold = plan_fold(vaults, shards, *rest)
    unknown = 0 if fold is None else sum(known is None for _, _, known in fold.shards)
    mine = SharedFold(fold, index, count, split) if fold_pays(unknown, count, os.cpu_count() or 1) else None
    said = gather_on_host(mine.key.hex if mine else None, timeout=timeout,
                          what="agree whether the shared build hashes the base beside its shares")
    keys = {key for _, key in said}
    return mine if mine is not None and len(keys) == 1 else None
