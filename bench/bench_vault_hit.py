"""A cache hit's cost in the vault: opening a complete combination, mapping every layer, closing.

A server start (or a cached adapter switch) whose every layer is in the cache spends its
time here, per layer: the combination is built once (256 small layers by default, so the
per-layer overhead shows rather than the bytes), then opened, fully mapped and closed
again, several times, in one process with a warm page cache. Printed: the median of each
phase, as this release's manifest has it (each layer mapped at its recorded data offset)
and as an older release's manifest has it (no offsets: each header read as it is mapped),
and the whole against the floor a hit cannot go below, measured in this run: opening,
stat-ing and mapping every layer file once.

    .venv/bin/python bench/bench_vault_hit.py            # 256 layers
    .venv/bin/python bench/bench_vault_hit.py --quick    # 32 layers
"""

from __future__ import annotations

import json
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


def _map_once(folder: str) -> float:
    """Seconds to open, stat and map every layer file once (the floor of serving them)."""
    import mmap

    files = [os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors")]
    started = time.perf_counter()
    mappings = []
    for path in files:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        os.fstat(fd)
        mappings.append(mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))
        os.close(fd)
    return time.perf_counter() - started


def _as_an_older_release(folder: str) -> None:
    """Rewrite the manifest as a release without recorded offsets wrote it."""
    from hostmem.vault.manifest import MANIFEST_NAME

    path = os.path.join(folder, MANIFEST_NAME)
    with open(path) as handle:
        data = json.load(handle)
    data.pop("layers_sha256", None)
    for layer in data["layers"]:
        layer.pop("data_offset", None)
        layer.pop("stamp", None)
    with open(path, "w") as handle:
        json.dump(data, handle)


def _medians(runs: list[dict]) -> dict[str, float]:
    return {phase: statistics.median(r[phase] for r in runs) for phase in runs[0]}


def _line(label: str, median: dict[str, float]) -> str:
    return (f"{label}: open {median['open'] * 1e3:.1f} ms, map {median['map'] * 1e3:.1f} ms, "
            f"close {median['close'] * 1e3:.1f} ms, total {median['total'] * 1e3:.1f} ms")


def main() -> None:
    args = bench_args(__doc__.splitlines()[0], "256", "32")
    layers = int(args.size_bytes)
    tmp = workdir(args)
    try:
        from hostmem.vault import Vault

        vault = Vault(os.path.join(args.workdir, "cache"))
        key = "ab" * 32
        folder = os.path.join(vault.cache, key)
        expected = _build(vault, key, layers)
        runs = [_hit(vault, key, expected) for _ in range(REPEATS)]
        floor = statistics.median(_map_once(folder) for _ in range(REPEATS))
        _as_an_older_release(folder)
        older = [_hit(vault, key, expected) for _ in range(REPEATS)]
    finally:
        if tmp is not None:
            tmp.cleanup()
    median, median_older = _medians(runs), _medians(older)
    lines = [_line(f"{layers} layers, median of {REPEATS} all-hit sessions", median),
             _line("  the same, manifest without offsets (headers read)", median_older),
             f"opening, stat-ing and mapping every layer file once: {floor * 1e3:.1f} ms; a hit costs "
             f"{median['total'] / floor:.1f}x that (with headers read: {median_older['total'] / floor:.1f}x)"]
    report("vault_hit", lines, {"layers": layers, "seconds": median, "seconds_headers_read": median_older,
                                "map_once_seconds": floor, "ratio_to_map_once": median["total"] / floor,
                                "ratio_to_map_once_headers_read": median_older["total"] / floor})


if __name__ == "__main__":
    main()
