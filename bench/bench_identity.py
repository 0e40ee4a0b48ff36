"""Content identity and the cache's starts, measured side by side in one run.

Prints three ratios, each against a baseline measured in the same run:

- identity hash rate / raw sequential read of the same file (cold page cache for
  both: the file's pages are dropped with ``posix_fadvise(DONTNEED)`` before each),
  the median of seven rounds, each a raw read and a hash, the read first in every other
  round (a virtual disk's rate swings from minute to minute, so each hash is compared
  with the read beside it); the
  issue asks >= 0.8;
- a start on an unchanged base with a complete cache / a start without LoRA (the
  checkpoint mapped, nothing merged), each from launching a fresh process to ready (one
  pass over every weight, as streaming them to a GPU reads them: ``bench_lora``'s start),
  the best of three in turns after one untimed round of each; <= 1.05;
- a first start on a copied base with the cache baked into a read-only root / a build
  of the same cache; <= 0.3. The read-only root is a read-only bind mount where the
  machine allows one, else a folder this run cannot write (as a non-root user);
- a first start on a new base from a cold page cache (the base's pages dropped as for
  the raw read, a fresh root, no digest known), the hash folded into the build
  (:mod:`hostmem.vault.fold`) / the base hashed first and then built; the best of two
  rounds in turns. ``--fold-window`` sets how far the hasher reads ahead of the build
  (0: only what the build has read already).

``python bench/bench_identity.py [--size 2GiB] [--layers 16] [--quick] [--fold-window 256MiB]``:
sizes are of the checkpoint; a GiB-sized one runs in about three minutes on a virtio disk.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import lora_cache  # noqa: E402
from bench_lora import scenario  # noqa: E402
from common import report, set_workdir_for_machine  # noqa: E402
from hostmem.units import format_rate, format_size, parse_size  # noqa: E402
from lora_cache.placement.layers import checkpoint_module  # noqa: E402
from hostmem.vault import fold  # noqa: E402
from hostmem.vault.content_hash import CONTENT_HASH_MEMO, file_digest, hash_name  # noqa: E402
from safetensors.torch import save_file  # noqa: E402


def drop_cache(path: str) -> None:
    """Write back and drop the file's pages, so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_read(path: str) -> float:
    """Seconds to read the file once, sequentially, in 8 MiB requests."""
    buffer = bytearray(8 << 20)
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as handle:
        while handle.readinto(buffer):
            pass
    return time.perf_counter() - started


def timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


HASH_ROUNDS = 7  # the disk swung 0.6-1.7 GiB/s between reads a few seconds apart: three rounds were not enough


def hash_against_read(path: str, rounds: int = HASH_ROUNDS) -> tuple[float, float]:
    """(raw read seconds, hash seconds) of the round with the median ratio of the two;
    the read goes first in every other round, the hash in the others."""
    pairs = []
    for round_ in range(rounds):
        timings = {}
        for kind in (("raw", "hash") if round_ % 2 == 0 else ("hash", "raw")):
            drop_cache(path)
            timings[kind] = raw_read(path) if kind == "raw" else timed(lambda: file_digest(path))
        pairs.append((timings["raw"], timings["hash"]))
    return sorted(pairs, key=lambda pair: pair[0] / pair[1])[len(pairs) // 2]


def make_inputs(folder: str, size: int, layers: int) -> tuple[str, str]:
    cols = 4096
    rows = max(1, size // layers // (cols * 2))
    gen = torch.Generator().manual_seed(0)
    tensors = {f"blocks.{i}.proj.weight": torch.randn(rows, cols, generator=gen).to(torch.bfloat16) for i in range(layers)}
    base = os.path.join(folder, "base.safetensors")
    save_file(tensors, base)
    adapter = {}
    for i in range(layers):
        adapter[f"blocks.{i}.proj.lora_down.weight"] = torch.randn(16, cols, generator=gen) / 64
        adapter[f"blocks.{i}.proj.lora_up.weight"] = torch.randn(rows, 16, generator=gen) / 64
    path = os.path.join(folder, "turbo.safetensors")
    save_file(adapter, path)
    return base, path


def start(base: str, adapter: str | None, roots) -> float:
    """Seconds a server's start takes: map the checkpoint, merge through the cache."""
    started = time.perf_counter()
    model = checkpoint_module([base])
    if adapter is not None:
        lora_cache.merge(model, [adapter], cache_root=roots, progress=False, rounding="merge")  # every layer
    for p in model.parameters():
        p.data.view(-1)[:: 4096 // p.element_size()].sum()  # touch every page once, as a first forward would
    seconds = time.perf_counter() - started
    if adapter is not None:
        lora_cache.unmerge(model)
    return seconds


def cold_first_start(base: str, adapter: str, root: str, hash_first: bool) -> float:
    """Seconds of a first start on a base no root knows, its pages out of the page cache:
    hashed first and then built (``hash_first``, as before the fold), or folded."""
    CONTENT_HASH_MEMO.clear()
    shutil.rmtree(root, ignore_errors=True)
    drop_cache(base)
    hashed = timed(lambda: CONTENT_HASH_MEMO.digest(os.path.realpath(base))) if hash_first else 0.0
    return hashed + start(base, adapter, root)


def fold_against_hash_first(base: str, adapter: str, scratch: str, rounds: int = 2) -> tuple[float, float]:
    """``(folded, hashed first)``: the best seconds of each, in turns."""
    best = {True: float("inf"), False: float("inf")}
    for _ in range(rounds):
        for hash_first in (True, False):
            seconds = cold_first_start(base, adapter, os.path.join(scratch, "cold-root"), hash_first)
            best[hash_first] = min(best[hash_first], seconds)
    shutil.rmtree(os.path.join(scratch, "cold-root"), ignore_errors=True)
    return best[False], best[True]


def process_starts(base: str, adapter: str, root: str) -> tuple[float, float]:
    """``(hit, without LoRA)``: the best launch-to-ready seconds of fresh processes started
    in turns, the first round untimed (it fills the page cache as a server's first start
    would)."""
    best = {"hit": float("inf"), "base": float("inf")}
    for round_ in range(4):
        for kind, extra in (("base", {}), ("hit", {"adapter": adapter, "root": root})):
            spawned = time.time()
            run = scenario("start", shards=[base], **extra)
            if round_:
                best[kind] = min(best[kind], run["ready_at"] - spawned)
    return best["hit"], best["base"]


def read_only(path: str, scratch: str) -> tuple[str, callable]:
    """``path`` as a read-only root, and how to undo it."""
    point = os.path.join(scratch, "ro")
    os.mkdir(point)
    if subprocess.run(["mount", "--bind", "-o", "ro", path, point], capture_output=True).returncode == 0:
        return point, lambda: subprocess.run(["umount", point], capture_output=True)
    os.rmdir(point)
    os.chmod(path, 0o555)  # effective for a non-root user only
    return path, lambda: os.chmod(path, 0o700)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="2GiB", help="checkpoint size (default 2GiB)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="a 256 MiB checkpoint of 8 layers")
    parser.add_argument("--dir", default=None, help="scratch folder on the disk to measure (default: $TMPDIR)")
    parser.add_argument("--fold-window", default=None, help="how far a folded hash reads ahead of the build "
                        f"(default {format_size(fold.FOLD_WINDOW)}; 0: only what the build has read)")
    args = parser.parse_args()
    if args.fold_window is not None:
        fold.FOLD_WINDOW = parse_size(args.fold_window)
    size, layers = (parse_size("256MiB"), 8) if args.quick else (parse_size(args.size), args.layers)
    scratch = tempfile.mkdtemp(prefix="bench-identity-", dir=args.dir)
    try:
        set_workdir_for_machine(scratch)
        base, adapter = make_inputs(scratch, size, layers)
        raw, hashed = hash_against_read(base)
        size = os.path.getsize(base)

        root = os.path.join(scratch, "root")
        built = start(base, adapter, root)  # a build (the base's digest is memoised from here on)
        hit, no_lora = process_starts(base, adapter, root)
        folded, hashed_first = fold_against_hash_first(base, adapter, scratch)

        copy_folder = os.path.join(scratch, "host")
        os.mkdir(copy_folder)
        copied = shutil.copy(base, os.path.join(copy_folder, "base.safetensors"))  # new inode and times
        baked, undo = read_only(root, scratch)
        try:
            first = start(copied, adapter, [baked, os.path.join(scratch, "local")])
        finally:
            undo()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report("identity", [
        f"identity hash ({hash_name()}): {format_rate(size / hashed)}, raw read: {format_rate(size / raw)} "
        f"({format_size(size)}, median of {HASH_ROUNDS} rounds): ratio {raw / hashed:.2f} (>= 0.8)",
        f"start with a complete cache {hit:.2f} s / without LoRA {no_lora:.2f} s: ratio {hit / no_lora:.2f} (<= 1.05)",
        f"first start on a copied base, cache baked read-only {first:.2f} s / a build {built:.2f} s: "
        f"ratio {first / built:.2f} (<= 0.3)",
        f"first start on a new base, cold: hash folded into the build {folded:.2f} s / hashed first, then built "
        f"{hashed_first:.2f} s: ratio {folded / hashed_first:.2f} (hasher at most "
        f"{format_size(fold.FOLD_WINDOW) if fold.FOLD_WINDOW is not None else 'any distance'} ahead of the build)",
    ], {"base_bytes": size, "hash": hash_name(), "hash_s": hashed, "raw_read_s": raw, "hash_to_read": raw / hashed,
        "hit_start_s": hit, "no_lora_start_s": no_lora, "hit_to_no_lora": hit / no_lora,
        "baked_first_start_s": first, "build_s": built, "baked_to_build": first / built,
        "cold_folded_start_s": folded, "cold_hash_first_start_s": hashed_first,
        "folded_to_hash_first": folded / hashed_first, "fold_window_bytes": fold.FOLD_WINDOW})
    return 0


if __name__ == "__main__":
    sys.exit(main())
