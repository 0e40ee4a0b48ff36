"""A shared build: the ranks of one host build a missing combination together, once.

A multi-GPU server runs one process per GPU, and every one of them calls
:func:`lora_cache.merge` with the same model and adapters. Unshared, the first rank to
take the key's lock builds every layer while the others wait; with a torch.distributed
process group initialised, :func:`build_shares` (run by ``merge`` before it opens the
vault, without being asked) splits the work instead:

1. the ranks meet (:func:`hostmem.gather_on_host`, ranks of one host found by
   hostname) and hash the key's input files not memoised yet (the base's shards, the
   adapters) together, each a disjoint set of files balanced by bytes
   (:func:`_hash_inputs`; a file's hash runs on one core, so one rank hashing them all
   in turn left the other cores and ranks idle), meet again to hand each other the
   digests, and every rank computes the key from them without reading a file again;
2. the lowest rank probes the vault cheaply (the manifest and the folder listing, no
   checksum read) for whether the combination is complete and which layers are
   missing, and one all-gather over the world makes every rank agree on it, and on the
   key (a rank whose key differs is named, on every rank). A hit everywhere ends here:
   ``merge`` then maps every layer read-only, as it always does;
3. on a miss, the host's missing layers are split into disjoint shares balanced by
   bytes, and each rank builds its share in parallel through a share session of the
   vault (:mod:`hostmem.vault.shares`), without installing anything. Each rank sums
   with its share of the host's cores (:func:`rank_threads`: cores / local ranks, at
   least 1), for its block workers and torch's own operations alike: a rank alone sums
   on every core, so four ranks each doing so would put four times the threads on the
   cores, and torch's OpenMP operations (the adapter's finiteness check) stall at every
   barrier when their threads are descheduled;
4. the ranks meet again; the lowest rank records every share's layers as verified
   (each writer checksummed them as it wrote them) and seals the manifest (a plain
   session that adopts the files without reading them again), the ranks meet once more,
   and ``merge`` opens the vault as usual: the combination is now sealed and verified,
   so every rank opens it with the key's lock held shared (:mod:`hostmem.vault.readers`)
   and maps every layer read-only at the same time as the others, where each took the
   lock exclusively in turn before.

A rank that dies, from the moment the build begins (each rank publishes its process
first), is named (rank and pid) by every other rank of its host within a second, at
whatever step: they wait at a gather looking every quarter of a second which of them
has ended (:mod:`lora_cache.shared_faults`), and each merges in place with one warning;
what was sealed stays, and the next start resumes. A rank that never arrives fails the
others at the first gather after ``rank_timeout`` seconds (a keyword of ``merge``,
default 600), naming it. No room at any step (the provisional folder, a share, the seal, the
re-key) is handed round at the next gather: the lowest rank removes a provisional
folder, and every rank merges in place with one warning; the next start builds. Other
share failures say so and leave the share's layers to the plain session. Without a
process group, processes on one key still never build twice: the second waits on the
key's lock and adopts.
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import sys
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from hostmem.errors import InputError
from hostmem.units import format_size

from ..key.base_shards import base_shards
from ..key.combination import Combination
from ..kernels.workers import cpu_count, workers_at_most
from ..layer_loop import CacheBuildError, MergeStats, merge_layers
from ..targets.layer_target import AddressSpace, LayerTarget
from .process_group import DEFAULT_TIMEOUT, check_rank_timeout, distributed_group
from .faults import PeerWatch, RankDiedError, cannot_store, storing, this_process, warn_in_place
from hostmem.vault import Vault, VaultError
from hostmem.vault.adoption import shape_dtype_problem
from hostmem.vault.content_hash import CONTENT_HASH_MEMO, file_digest
from hostmem.vault.durable import remove_tree
from hostmem.vault.layer_file import layer_file_name
from hostmem.vault.manifest import ManifestError, read_manifest
from hostmem.vault.roots import keyer
from hostmem.vault.session import say
from hostmem.vault.shares import open_share, vouch_for

__all__ = ["DEFAULT_TIMEOUT", "ShareOutcome", "build_shares", "check_rank_timeout", "split_by_bytes", "probe",
           "rank_threads"]


@dataclass
class ShareOutcome:
    """What this rank built of a shared build: share ``index`` of ``count``."""

    index: int
    count: int
    built: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    error: str | None = None
    no_room: str | None = None  # why this share could not be stored (the disk had no room)
    in_place: str | None = None  # why the host's ranks merge in place (``merge`` then opens no cache)
    written: list = field(default_factory=list)  # what the share wrote, for the others to trust

    def account(self, stats: MergeStats) -> None:
        """Count the layers this rank built in its share as built, not as hits (the plain
        session that followed found them all sealed)."""
        moved = min(self.built, stats.hit)
        stats.hit -= moved
        stats.built += moved
        stats.bytes_written += self.bytes_written
        stats.seconds += self.seconds


def probe(vaults: list[Vault], key: str, expected: dict) -> tuple[bool, list[str]]:
    """``(complete, missing)`` of ``key`` in ``vaults``, cheaply: manifests and folder
    listings only. Complete in some root: ``(True, [])``; else the expected layers of the
    first writable root that have neither a manifest entry nor a layer file. No writable
    root: ``(False, [])`` (nothing can be built)."""
    for vault in vaults:
        folder = os.path.join(vault.cache, key)
        try:
            manifest = read_manifest(folder) if os.path.isdir(folder) else None
        except (ManifestError, OSError):
            manifest = None
        recorded = manifest.layers if manifest is not None else {}
        if manifest is not None and manifest.complete and all(
            n in recorded and shape_dtype_problem(recorded[n], s, d) is None for n, (s, d) in expected.items()
        ):
            return True, []
        if not vault.read_only:
            present = set(os.listdir(folder)) if os.path.isdir(folder) else set()
            return False, [n for n in expected if n not in recorded and layer_file_name(n) not in present]
    return False, []


def split_by_bytes(targets: list[LayerTarget], count: int) -> list[list[LayerTarget]]:
    """``targets`` in ``count`` disjoint shares of about equal bytes (largest first, each to
    the lightest share), each share in the model's order. The same on every rank."""
    shares: list[list[LayerTarget]] = [[] for _ in range(count)]
    loads = [0] * count
    order = {id(t): i for i, t in enumerate(targets)}
    for target in sorted(targets, key=lambda t: (-t.nbytes, order[id(t)])):
        lightest = min(range(count), key=lambda i: (loads[i], i))
        shares[lightest].append(target)
        loads[lightest] += target.nbytes
    return [sorted(share, key=lambda t: order[id(t)]) for share in shares]


def rank_threads(local_ranks: int, cores: int | None = None) -> int:
    """The threads each of ``local_ranks`` ranks building at once sums with: its share of
    the host's ``cores`` (default: the CPUs this process may run on), at least 1."""
    return max(1, (cpu_count() if cores is None else cores) // max(1, local_ranks))


@contextlib.contextmanager
def share_of_cores(threads: int):
    """Within: this rank's block workers and torch's own threads at most ``threads``;
    torch's thread count is restored after, also on an error."""
    before = torch.get_num_threads()
    torch.set_num_threads(min(before, threads))
    try:
        with workers_at_most(threads):
            yield
    finally:
        torch.set_num_threads(before)


def _detached(target: LayerTarget) -> LayerTarget:
    """``target`` over a stand-in module holding the same base parameter (no copy): a share
    build installs the merged view there and drops it, and the model is left untouched
    until ``merge`` maps every layer for real."""
    holder = nn.Module()
    holder.register_parameter("weight", target.current)
    return LayerTarget(target.name, holder, "weight", target.deltas)


def _build_share(vault: Vault, key, mine: list[LayerTarget], index: int, count: int, device, kernels,
                 progress, threads: int) -> ShareOutcome:
    """Build this rank's share on ``threads`` threads; a share the vault cannot store says
    why and builds nothing more."""
    outcome, reason = ShareOutcome(index, count), None
    if not mine:
        return outcome
    total = sum(t.nbytes for t in mine)
    say(f"LoRA merge cache {key.hex[:12]}: building share {index + 1} of {count} "
        f"({len(mine)} layers, {format_size(total)}, {threads} summing thread{'s' if threads > 1 else ''})")
    expected = {t.name: (tuple(t.current.shape), t.current.dtype) for t in mine}
    try:
        with open_share(vault, key, expected, index, count) as session:
            try:
                with share_of_cores(threads):
                    stats = merge_layers([_detached(t) for t in mine], session, device=device, progress=progress,
                                         fallback=False, kernels=kernels)
            finally:
                outcome.written, reason = session.written(), session.last_error
    except (CacheBuildError, VaultError, OSError) as exc:
        outcome.error = str(exc)
        if cannot_store(exc):  # every rank falls back in place, each with one warning
            why = (reason if isinstance(exc, CacheBuildError) and reason else str(exc)).rstrip(". ")
            outcome.no_room = (f"the LoRA merge cache could not store share {index + 1} of {count} "
                               f"of {key.hex[:12]} ({why})")
            return outcome
        say(f"LoRA merge cache {key.hex[:12]}: share {index + 1} of {count} stopped ({exc}); "
            "its remaining layers are built when the cache is opened")
        return outcome
    outcome.built, outcome.bytes_written, outcome.seconds = stats.built, stats.bytes_written, stats.seconds
    return outcome


def _same_key(host: list[tuple[int, dict]], key: str) -> None:
    """Every rank of the host computed ``key``; else name the ranks that differ."""
    other = [(rank, p["key"]) for rank, p in host if p["key"] != key]
    if other:
        raise InputError(
            "the ranks of this host computed different LoRA merge cache keys ("
            + ", ".join(f"rank {r}: {k[:12]}" for r, k in [(host[0][0], host[0][1]["key"]), *other])
            + "): every rank must merge the same adapters into the same checkpoint with the same "
            "settings for a shared build; merge the differing ones with torch.distributed not initialised"
        )


def _key_or_fold(vaults, targets, combination: Combination, base_files, index: int, count: int, timeout: float):
    """``(key, None)`` with every input hashed first, together; or ``(provisional key,
    SharedFold)`` where the ranks hash the base beside their shares
    (:mod:`lora_cache.shared_fold`). A collective."""
    from .fold import fold_pays, plan_shared_fold

    memo_file = keyer(vaults).memo_file
    shards = base_shards(targets, base_files, AddressSpace())
    if fold_pays(len(shards), count, os.cpu_count() or 1):  # the same on every rank of the host
        _hash_inputs(sorted({os.path.realpath(os.fspath(f.path)) for f in combination.files}), index, count,
                     memo_file, timeout)
        rest = combination.inputs_but_base(vaults)
        fold = plan_shared_fold(vaults, shards, rest, index, count, _split_files, timeout)
        if fold is not None:
            return fold.key, fold
    _hash_inputs(_input_files(targets, combination.files, base_files), index, count, memo_file, timeout)
    return combination.key(vaults, shards), None  # from the digests


def _input_files(targets, files, base_files) -> list[str]:
    """The files whose content digests the key is made of: the base's shards holding the
    targets, and the adapters."""
    paths = base_shards(targets, base_files, AddressSpace()) + [f.path for f in files]
    return sorted({os.path.realpath(os.fspath(p)) for p in paths})


def _split_files(paths: list[str], count: int) -> list[list[str]]:
    """``paths`` in ``count`` disjoint sets of about equal bytes (largest first, each to the
    lightest set); the same on every rank that lists the same paths."""
    sets: list[list[str]] = [[] for _ in range(count)]
    loads = [0] * count
    for path in sorted(paths, key=lambda p: (-os.path.getsize(p), p)):
        lightest = min(range(count), key=lambda i: (loads[i], i))
        sets[lightest].append(path)
        loads[lightest] += os.path.getsize(path)
    return sets


def _hash_inputs(paths: list[str], index: int, count: int, memo_file: str | None, timeout: float) -> None:
    """Hash the files of ``paths`` not memoised yet across the host's ``count`` ranks (this
    rank: set ``index``), then hand the digests round (a collective) and memoise them all
    in this process, the lowest rank also on disk. A file two ranks disagree about (one
    memoised it already) is hashed at most twice, and one left out is hashed when the key
    is computed: the key never depends on the split."""
    missing = [p for p in paths if CONTENT_HASH_MEMO.known(p, memo_file)[1] is None]
    mine = []
    for path in _split_files(missing, count)[index]:
        stamp, _ = CONTENT_HASH_MEMO.known(path, memo_file)
        mine.append((path, stamp, file_digest(path)))
    from hostmem.host_ledger import gather_on_host

    for _, hashed in gather_on_host(mine, timeout=timeout, what="hand the input digests to the host's ranks"):
        for path, stamp, digest in hashed:  # refused (an error) where the file changed since it was hashed
            CONTENT_HASH_MEMO.record(path, list(stamp), digest, memo_file if index == 0 else None)


def _agree(dist, vaults: list[Vault], key, expected: dict, leader: bool, no_room: str | None):
    """``(build anywhere, build here, missing layers, why this host cannot store)``, the
    same on every rank of a host: the host's lowest rank probes, every rank's key must be
    its leader's (else every rank of the world raises, naming the ranks that differ). One
    all-gather over the world."""
    complete, missing = probe(vaults, key.hex, expected) if leader and not no_room else (True, [])
    writable = any(not v.read_only for v in vaults)
    mine = (socket.gethostname(), dist.get_rank(), {"key": key.hex, "complete": complete or not writable,
                                                     "missing": missing, "no_room": no_room})
    world: list = [None] * dist.get_world_size()
    dist.all_gather_object(world, mine)
    hosts: dict[str, list] = {}
    for host, rank, payload in world:
        hosts.setdefault(host, []).append((rank, payload))
    for ranks in hosts.values():
        _same_key(ranks, ranks[0][1]["key"])
    first = hosts[mine[0]][0][1]
    build_here = not first["complete"] or first["no_room"] is not None
    anywhere = any(not ranks[0][1]["complete"] or ranks[0][1]["no_room"] for ranks in hosts.values())
    return anywhere, build_here, set(first["missing"]) if build_here else set(), first["no_room"]


def build_shares(targets: list[LayerTarget], combination: Combination, roots: list[str], max_size, base_files,
                 device, kernels, progress=None, timeout: float = DEFAULT_TIMEOUT,
                 at_runtime: frozenset[str] = frozenset()) -> ShareOutcome | None:
    """Build the missing layers of this combination across the ranks of this host (a
    collective: every rank of the world calls it). None when there is no process group,
    or nothing to build anywhere; else what this rank built (see the module's docstring),
    whose ``in_place`` says why the host could not store it (``merge`` then merges in
    place). ``timeout``: the seconds a rank waits for the others at each gather.
    ``combination``: what the key covers, gathered once by ``merge`` (the adapters, their
    strengths, the policy, the whole model's form): the ranks key from it, never re-key.
    ``device`` and ``kernels``: where and how this rank sums its share.
    ``at_runtime``: targets the key covers that are served at run time, never built
    (:mod:`lora_cache.placement.rounding`).
    """
    dist = distributed_group()
    if dist is None or not roots or not targets:
        return None
    from hostmem.host_ledger import gather_on_host, watching  # here: a start without a process group never needs it

    watch = PeerWatch(dist)  # this rank's process published before any gather: a death from now on is named
    try:
        with watching(watch.check), watch.naming_the_dead("a shared LoRA merge build"):
            met = gather_on_host(this_process(), timeout=timeout, what="start a shared LoRA merge build")
            ranks = [rank for rank, _ in met]
            return _build_together(dist, targets, combination, [Vault(root, max_size) for root in roots],
                                   base_files, device, kernels, progress, timeout, ranks.index(dist.get_rank()),
                                   len(ranks), at_runtime)
    except RankDiedError as exc:  # every surviving rank names it and merges in place
        return warn_in_place(ShareOutcome(0, 1), str(exc).rstrip("."))


def _build_together(dist, targets, combination, vaults, base_files, device, kernels, progress, timeout: float,
                    index: int, count: int, at_runtime: frozenset[str]) -> ShareOutcome | None:
    """:func:`build_shares` once the host's ranks have met: share ``index`` of ``count``."""
    from hostmem.host_ledger import gather_on_host

    key, fold = _key_or_fold(vaults, targets, combination, base_files, index, count, timeout)
    expected = {t.name: (tuple(t.current.shape), t.current.dtype) for t in targets if t.name not in at_runtime}
    # the lowest rank marks a provisional folder before any rank can write a share there (the others wait below)
    no_room = storing(fold.mark, key)[1] if fold is not None and index == 0 else None
    anywhere, build_here, todo, no_room = _agree(dist, vaults, key, expected, index == 0, no_room)
    if not anywhere:
        return None
    writable = next((v for v in vaults if not v.read_only), None)
    mine = [] if no_room else split_by_bytes([t for t in targets if t.name in todo], count)[index]
    started = time.monotonic()
    if fold is not None and not no_room:
        fold.start()  # this rank's shards of the base, hashed beside its share
    outcome = _build_share(writable, key, mine, index, count, device, kernels, progress, rank_threads(count))
    handed = {"built": outcome.built, "written": outcome.written, "no_room": no_room or outcome.no_room,
              "hashed": fold.hashed() if fold is not None else None}
    finished = gather_on_host(handed, timeout=timeout,
                              what=f"finish the shared build of LoRA merge cache {key.hex[:12]}")
    no_room = next((p["no_room"] for _, p in finished if p["no_room"]), None)
    real = fold.real_key([p["hashed"] for _, p in finished]) if fold is not None and not no_room else None
    if build_here and index == 0:
        no_room = _seal_or_drop(writable, key, expected, finished, (fold, real), no_room, started)
    sealed = gather_on_host(no_room, timeout=timeout, what=f"seal the shared build of LoRA merge cache {key.hex[:12]}")
    no_room = next((p for _, p in sealed if p), None)
    return warn_in_place(outcome, no_room) if no_room else outcome


def _seal_or_drop(writable: Vault, key, expected: dict, finished: list, folded: tuple, no_room, started: float):
    """The lowest rank, once every share is done: seal what the shares built (``folded``:
    the fold and the real key, or Nones), unless a rank had no room. Where it is not
    sealed, a provisional folder is removed (nothing provisional stays). Why the host
    cannot store the build, or None."""
    fold, real = folded
    if not no_room:
        trusted, no_room = storing(lambda: _seal(writable, key, expected, finished, fold, real), key)
    if no_room:
        if fold is not None:
            remove_tree(fold.folder)
        return no_room
    say(f"LoRA merge cache {(real or key).hex[:12]}: {len(finished)} ranks built "
        f"{sum(p['built'] for _, p in finished)} layers in {time.monotonic() - started:.1f} s ({trusted} sealed "
        f"and checksummed as written{', the base hashed beside them' if real is not None else ''})")
    return None


def _seal(writable: Vault, key, expected: dict, finished: list, fold, real) -> int:
    """The lowest rank: vouch for every share's layers, seal the manifest (adopting the
    shares' files), and name a folded build by its ``real`` key; how many were vouched for.

    What the vault says meanwhile is held back: where the combination is not sealed after
    (no room for the manifest or the re-key), it is the reason every rank warns with,
    once, and an OSError says it; else it is said as it was."""
    held = io.StringIO()
    with contextlib.redirect_stderr(held):
        trusted = vouch_for(writable, key.hex, [w for _, p in finished for w in p["written"]])
        with writable.open(key, expected) as session:  # adopts the shares' files as vouched for, seals
            if real is not None:
                session.after_seal = fold.rekey_after_seal(real)  # then names it by its real key
    said = held.getvalue()
    if not probe([writable], (real or key).hex, expected)[0]:
        raise OSError("; ".join(line.removeprefix("hostmem: ") for line in said.splitlines() if line.strip())
                      or "the manifest was not sealed")
    sys.stderr.write(said)
    return trusted
