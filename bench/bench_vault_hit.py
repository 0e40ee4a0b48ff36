"""A cache hit's cost in the vault: opening a complete combination, mapping every layer, closing.

A server start (or a cached adapter switch) whose every layer is in the cache spends its
time here, per layer: the combination is built once (256 small layers by default, so the
per-layer overhead shows rather than the bytes), then opened, fully mapped and closed
again, several times, in one process with a warm page cache. Printed: the median of each
phase, and the whole against the time to read the same layer files' headers once (the
floor a hit must read anyway), both measured in this run:

    .venv/bin/python bench/bench_vault_hit.py            # 256 layers
    .venv/bin/python bench/bench_vault_hit.py --quick    # 32 layers
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from common import bench_args, report, workdir  # noqa: E402 (sets sys.path)

REPEATS = 9


def _build(vault, key: str, layers: int) -> dict:
    """Put ``layers`` 64 KiB layers under ``key``; return what a start expects of them."""
    expected = {}
    with vault.open(key) as session:
        for i in range(layers):
            name = f"blocks.{i}.proj.weight"
            session.put(name, torch.full((128, 128), float(i)))
            expected[name] = ((128, 128), torch.float32)
    return expected


def _hit(vault, key: str, expected: dict) -> dict[str, float]:
    """One all-hit session: seconds to open it, map every layer, close it."""
    started = time.perf_counter()
    session = vault.open(key, expected)
    opened = time.perf_counter()
    views = [session.get(n, s, d) for n, (s, d) in expected.items()]
    mapped = time.perf_counter()
    session.close()
    closed = time.perf_counter()
    assert all(v is not None for v in views) and session.complete
    del views
    return {"open": opened - started, "map": mapped - opened, "close": closed - mapped, "total": closed - started}


def _headers_once(folder: str) -> float:
    """Seconds to read every layer file's header once (the floor of mapping them)."""
    from hostmem.safetensors_header import read_header

    files = [os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors")]
    started = time.perf_counter()
    for path in files:
        read_header(path)
    return time.perf_counter() - started


def main() -> None:
    args = bench_args(__doc__.splitlines()[0], "256", "32")
    layers = int(args.size_bytes)
    tmp = workdir(args)
    try:
        from hostmem.vault import Vault

        vault = Vault(os.path.join(args.workdir, "cache"))
        key = "ab" * 32
        expected = _build(vault, key, layers)
        runs = [_hit(vault, key, expected) for _ in range(REPEATS)]
        floor = statistics.median(_headers_once(os.path.join(vault.cache, key)) for _ in range(REPEATS))
    finally:
        if tmp is not None:
            tmp.cleanup()
    median = {phase: statistics.median(r[phase] for r in runs) for phase in runs[0]}
    lines = [f"{layers} layers, median of {REPEATS} all-hit sessions: open {median['open'] * 1e3:.1f} ms, "
             f"map {median['map'] * 1e3:.1f} ms, close {median['close'] * 1e3:.1f} ms, "
             f"total {median['total'] * 1e3:.1f} ms",
             f"reading every header once: {floor * 1e3:.1f} ms; a hit costs {median['total'] / floor:.1f}x that"]
    report("vault_hit", lines, {"layers": layers, "seconds": median, "headers_once_seconds": floor,
                                "ratio_to_headers_once": median["total"] / floor})


if __name__ == "__main__":
    main()
