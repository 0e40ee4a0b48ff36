"""bench_lora's verdict: every ratio the merge is judged by, with the figures beside it."""

from __future__ import annotations

import os
import statistics

from common import format_size, report

def _rate(run: dict) -> float:
    done = run.get("stats", run)  # a build reports its MergeStats
    return done["bytes"] / done["seconds"]


def _rates(rates: list[float]) -> str:
    return ", ".join(f"{format_size(r)}/s" for r in rates)


def _bound(build_rates: list[float], **bounds: list[float]) -> dict:
    """Which bound holds for the build, and its ratio: the tightest by median of ``bounds``
    (per round: ``disk``, the raw write; ``CPU``, summing and writing's CPU time over the
    cores, as they share them; ``sum``, the arithmetic alone, where it leaves cores idle),
    judged at >= 0.8 of the disk's or >= 0.9 of the others; either way the median over the
    rounds of the build against the same round's bound."""
    name = min(bounds, key=lambda kind: statistics.median(bounds[kind]))
    ratio = statistics.median([b / r for b, r in zip(build_rates, bounds[name])])
    return {"build_bound": name, "build_over_bound": ratio, "build_goal": 0.8 if name == "disk" else 0.9}


def _cpu_bound(runs: dict) -> list[float]:
    """Per round, the rate the CPU alone allows a build: the CPU time the arithmetic and the
    write path took (every thread of each, process time) shared over the machine's cores.
    Summing and writing run on the same cores, so where this is near the raw write's rate,
    neither bound is reached: each takes the cores the other would use."""
    cores = os.cpu_count() or 1
    return [a["bytes"] / ((a["cpu_seconds"] + w["cpu_seconds"]) / cores)
            for a, w in zip(runs["arithmetic"], runs["write_path"])]


def build_verdict(runs: dict, requests: dict, rounds: int) -> tuple[dict, list[str], dict]:
    """The build rounds judged: ``(ratios, lines, figures)`` (figures: the JSON's, bytes)."""
    rates = {kind: [_rate(run) for run in found] for kind, found in runs.items()}
    request_bytes = {kind: sum(found) / len(found) for kind, found in requests.items() if found}
    best = {kind: max(found) for kind, found in rates.items()}
    raw_rate = max(best["buffered"], best["direct"])  # the disk at its best, whichever way gets it
    build_rate = best["build"]
    # The same round's raw write (or arithmetic), seconds away on the same machine: the ratio
    # judged is the median of these, which one lucky moment for either side cannot move.
    disk_rates = [max(d, f) for d, f in zip(rates["direct"], rates["buffered"])]
    by_round = [b / d for b, d in zip(rates["build"], disk_rates)]
    by_round_sum = [b / a for b, a in zip(rates["build"], rates["arithmetic"])]
    cpu_rates = _cpu_bound(runs)
    bound = _bound(rates["build"], disk=disk_rates, CPU=cpu_rates, sum=rates["arithmetic"])
    tighter = [min(c, d) for c, d in zip(cpu_rates, disk_rates)]
    by_round_tighter = [b / t for b, t in zip(rates["build"], tighter)]
    cpu_per_gib = [(1 << 30) / c * (os.cpu_count() or 1) for c in cpu_rates]
    ratios = {
        "build_over_bound": bound["build_over_bound"],
        "build_over_raw_write": statistics.median(by_round),
        "build_over_raw_write_best_of": build_rate / raw_rate,
        "build_over_arithmetic": statistics.median(by_round_sum),
        "build_over_arithmetic_best_of": build_rate / best["arithmetic"],
        "write_path_over_raw_write": best["write_path"] / raw_rate,
        "arithmetic_over_raw_write": best["arithmetic"] / raw_rate,
        "build_over_buffered_write": build_rate / best["buffered"],
        "build_over_tighter_of_disk_and_cpu": statistics.median(by_round_tighter),
    }
    arithmetic = runs["arithmetic"][-1]
    timings = "; ".join(f"{cls}: " + ", ".join(f"{k} {v:.2f} s/GiB" for k, v in entry["seconds_per_gib"].items())
                        for cls, entry in arithmetic["wisdom"].items())
    lines = [
        f"kernels chosen: {arithmetic['kernels']} (timed: {timings or 'no choice to time'})",
        f"the build's bound: the {bound['build_bound']}'s; build / " + {
            "disk": "raw write", "CPU": "the CPU's bound (below)", "sum": "fastest kernel (arithmetic alone)"}[
            bound["build_bound"]] + f", median by round {bound['build_over_bound']:.2f} (goal >= {bound['build_goal']})",
        "cache build / raw sequential write, round by round (both in every round, the faster of "
        f"O_DIRECT and buffered): {', '.join(f'{r:.2f}' for r in by_round)}  -> median "
        f"{ratios['build_over_raw_write']:.2f}",
        f"cache build / arithmetic alone, round by round: {', '.join(f'{r:.2f}' for r in by_round_sum)}  -> median "
        f"{ratios['build_over_arithmetic']:.2f}",
        f"  best of {rounds} each: cache build {format_size(build_rate)}/s, raw {format_size(raw_rate)}/s  -> "
        f"ratio {ratios['build_over_raw_write_best_of']:.2f}; arithmetic alone {format_size(best['arithmetic'])}/s"
        f"  -> ratio {ratios['build_over_arithmetic_best_of']:.2f}",
        f"  the cache's write path alone (no arithmetic) {format_size(best['write_path'])}/s  -> ratio "
        f"{ratios['write_path_over_raw_write']:.2f}; its arithmetic alone (no disk) -> ratio "
        f"{ratios['arithmetic_over_raw_write']:.2f}",
        f"  build / buffered write + fsync {ratios['build_over_buffered_write']:.2f}",
        f"  the CPU's bound: summing and writing took {statistics.median(cpu_per_gib):.2f} core-seconds per GiB, "
        f"so {os.cpu_count()} cores allow {format_size(statistics.median(cpu_rates))}/s (median by round, "
        f"against the raw write's {format_size(statistics.median(rates['direct']))}/s); build / the tighter of "
        f"the two, round by round: {', '.join(f'{r:.2f}' for r in by_round_tighter)}  -> median "
        f"{ratios['build_over_tighter_of_disk_and_cpu']:.2f}",
        *(f"  every {kind} run: {_rates(found)}" for kind, found in rates.items()),
        *(["  the disk's average write request: " + ", ".join(
            f"{kind} {format_size(size)}" for kind, size in request_bytes.items())] if request_bytes else []),
    ]
    figures = {
        "build_bound": bound["build_bound"], "kernels": arithmetic["kernels"], "kernel_wisdom": arithmetic["wisdom"],
        "build_bytes_per_s": build_rate, "raw_write_bytes_per_s": raw_rate, "runs_bytes_per_s": rates,
        "build_over_raw_write_by_round": by_round, "build_over_arithmetic_by_round": by_round_sum,
        "average_write_request_bytes": request_bytes, "cpu_bound_bytes_per_s": cpu_rates,
        "cpu_seconds_per_gib": cpu_per_gib,
        "build_seconds": min(b["stats"]["seconds"] for b in runs["build"]),
    }
    return ratios, lines, figures


def summarize_build(merged: int, runs: dict, requests: dict, layers: int, rank: int, rounds: int) -> None:
    """Print and report the build rounds alone (``bench_lora.py --build-only``)."""
    from hostmem.crc32 import CRC32_IMPLEMENTATION

    ratios, lines, figures = build_verdict(runs, requests, rounds)
    head = f"model: {format_size(merged)} bf16, {layers} layers, rank-{rank} adapter on every layer; " \
           f"CRC-32 by {CRC32_IMPLEMENTATION}; the build rounds alone"
    report("bench_lora_build", [head, *lines], {
        "model_bytes": merged, "layers": layers, "rank": rank, "crc32_implementation": CRC32_IMPLEMENTATION,
        **ratios, **figures,
    })


def start_verdict(starts: dict) -> tuple[dict, list[str], dict]:
    """The start with a cache hit against the start without LoRA, launch to ready, judged at
    <= 1.05: one plus the difference of the parts where the two differ (after the imports
    both make; the hit's import of lora_cache and its merge fall in it), median against
    median, over the base start's whole median. Up to that point both run the same code,
    so whatever separates them there is the machine's noise (a start's imports swing by
    ~0.3 s from one launch to the next): the rounds' own ratios, launch to ready (the two
    starts seconds apart, which goes first alternating), and the best of each kind are
    shown beside it. ``starts``: ``{"hit"|"base": [{total, after_imports, full_collections}]}``."""
    hit, base = starts["hit"], starts["base"]
    by_round = [h["total"] / b["total"] for h, b in zip(hit, base)]
    median = {kind: {part: statistics.median(run[part] for run in runs) for part in ("total", "after_imports")}
              for kind, runs in starts.items()}
    best = {kind: {part: min(run[part] for run in runs) for part in ("total", "after_imports")}
            for kind, runs in starts.items()}
    added = median["hit"]["after_imports"] - median["base"]["after_imports"]
    ratios = {"hit_start_over_base_start": 1 + added / median["base"]["total"],
              "hit_start_over_base_start_by_round": statistics.median(by_round),
              "hit_start_over_base_start_best": best["hit"]["total"] / best["base"]["total"],
              "hit_over_base_after_imports": median["hit"]["after_imports"] / median["base"]["after_imports"]}
    collections = {kind: sum(run["full_collections"] for run in runs) for kind, runs in starts.items()}
    lines = [
        f"start (launch to ready), {len(by_round)} rounds of one start each: the cache hit adds "
        f"{added * 1000:+.0f} ms (median, after the imports both make: hit {median['hit']['after_imports']:.3f} s, "
        f"base {median['base']['after_imports']:.3f} s) to the base start's {median['base']['total']:.2f} s  -> "
        f"ratio {ratios['hit_start_over_base_start']:.3f} (goal <= 1.05)",
        f"  launch to ready, round by round: {', '.join(f'{r:.2f}' for r in sorted(by_round))}  -> median "
        f"{ratios['hit_start_over_base_start_by_round']:.3f}; best of each: cache hit {best['hit']['total']:.2f} s, "
        f"base {best['base']['total']:.2f} s  -> ratio {ratios['hit_start_over_base_start_best']:.3f}",
        f"  full garbage collections after the imports: hit {collections['hit']}, base {collections['base']} "
        "(each start runs one just before)",
    ]
    figures = {"hit_start_s": median["hit"]["total"], "base_start_s": median["base"]["total"],
               "hit_after_imports_s": median["hit"]["after_imports"],
               "base_after_imports_s": median["base"]["after_imports"], "hit_start_over_base_start_rounds": by_round,
               "starts": starts}
    return ratios, lines, figures


def summarize(merged, in_place, runs, starts, requests, first, layers: int, rank: int, rounds: int) -> None:
    """Print and report every ratio; ``layers``, ``rank``, ``rounds``: how the model and the runs were made."""
    from hostmem.crc32 import CRC32_IMPLEMENTATION

    build_ratios, build_lines, build_figures = build_verdict(runs, requests, rounds)
    build = max(runs["build"], key=lambda b: b["growth"])  # the largest growth of any build is the one judged
    start_ratios, start_lines, start_figures = start_verdict(starts)
    miss_s, peft_s, busy_s = min(first["miss"]), min(first["peft"]), min(first["busy"])
    peft_growth, peft_merge_s = min(first["peft_growth"]), min(first["peft_merge_s"])
    layer = merged // layers
    ratios = {
        "first_start_miss_over_peft": miss_s / peft_s,
        "first_start_busy_over_idle": busy_s / miss_s,
        "in_place_growth_over_peft_plus_layer": in_place["growth"] / (peft_growth + layer),
        "in_place_time_over_peft": in_place["stats"]["seconds"] / peft_merge_s,
        "peak_anon_cached_over_in_place": build["growth"] / max(1, in_place["growth"]),
        **build_ratios,
        **start_ratios,
    }
    lines = [
        f"model: {format_size(merged)} bf16, {layers} layers, rank-{rank} adapter on every layer; "
        f"CRC-32 by {CRC32_IMPLEMENTATION}",
        f"first start, empty cache: {miss_s:.2f} s; with peft's merge_and_unload instead: {peft_s:.2f} s"
        f"  -> ratio {ratios['first_start_miss_over_peft']:.2f} (goal <= 1.0)",
        f"  with one busy process per core: {busy_s:.2f} s  -> ratio {ratios['first_start_busy_over_idle']:.2f} "
        "of the idle first start (goal <= 2.0)",
        *build_lines,
        *start_lines,
        f"in place: anonymous growth {format_size(in_place['growth'])}, peft's {format_size(peft_growth)} + one "
        f"layer {format_size(layer)}  -> ratio {ratios['in_place_growth_over_peft_plus_layer']:.2f} (goal <= 1.0)",
        f"  merge time {in_place['stats']['seconds']:.2f} s, peft's merge {peft_merge_s:.2f} s  -> ratio "
        f"{ratios['in_place_time_over_peft']:.2f} (goal <= 1.0); cached build's growth / in place "
        f"{ratios['peak_anon_cached_over_in_place']:.3f}",
    ]
    report("bench_lora", lines, {
        "model_bytes": merged, "layers": layers, "rank": rank, "crc32_implementation": CRC32_IMPLEMENTATION, **ratios,
        "first_start_miss_s": miss_s, "first_start_peft_s": peft_s, "first_start_busy_s": busy_s,
        "peak_anon_growth_cached_bytes": build["growth"], "peak_anon_growth_in_place_bytes": in_place["growth"],
        "peak_anon_growth_peft_bytes": peft_growth, "peft_merge_seconds": peft_merge_s, **build_figures,
        "in_place_seconds": in_place["stats"]["seconds"],
        **start_figures,
    })
