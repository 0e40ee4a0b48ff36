"""Run every benchmark, one after another, and write their figures to BENCHMARKS.md.

Each benchmark prints readable lines and then one JSON line; each measures its own
baseline in the same run and prints the ratio. ``make bench`` runs this with
``--write``, which replaces BENCHMARKS.md with the figures of this run.

    python bench/run_all.py            # full sizes (GiB), several minutes
    python bench/run_all.py --quick    # smoke run at MiB sizes
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BENCHES = (
    ("bench_accountant.py", "Accountant: classify every parameter of a file-backed model", ""),
    ("bench_tracker.py", "Peak tracker: CPU overhead at the default interval",
     "With the second core busy, the wall-clock ratio includes the sampler's own share of the two "
     "cores; the loop's CPU-time ratio is the tracker's cost to the tracked code."),
    ("bench_plan.py", "Planner: `hostmem plan` on a 4 GiB checkpoint folder", ""),
    ("bench_lora.py", "LoRA merge cache: anonymous peak, build throughput, start time",
     "The raw baseline is the faster of a buffered write and an O_DIRECT write (into blocks "
     "allocated up front, from a buffer on huge pages) of the same bytes. Five rounds in a "
     "rotating order run every kind once each; the build is judged against the raw write of "
     "the same round, seconds apart (the median of the five), with the best of five of each "
     "beside it. 'write path' is the vault storing ready layers (checksum, O_DIRECT, fsync) as "
     "any caller would put them: the cache's own cost. The build streams each layer to disk "
     "while it is summed: one output buffer, whose stretches the writer puts on disk as the "
     "sum finishes them and the next layer reuses once written (a bf16 base and one bf16 "
     "adapter sum in one pass of torch's bf16 addmm on both cores, fp32 inside, one rounding; "
     "the summing threads run at nice +10 so the writer gets a core the moment a write ends; "
     "the CRC-32 is ISA-L's, over 20 GiB/s on one core). The merge buffer sits on 2 MiB pages, "
     "so the disk gets requests of about 3.3 MiB; from heap buffers of scattered 4 KiB pages "
     "it got 0.5-1.6 MiB ones and ran at 0.55-0.7 of "
     "raw. This virtual disk's own rate swings between about 1.1 and 3.4 GiB/s from one "
     "minute to the next, hence the interleaved rounds."),
)


def run_one(script: str, quick: bool) -> tuple[list[str], dict | None, int]:
    """Run one benchmark; return its readable lines, its JSON summary and its exit code."""
    command = [sys.executable, os.path.join(HERE, script)] + (["--quick"] if quick else [])
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env)
    lines, summary = [], None
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            summary = json.loads(line)
        else:
            lines.append(line)
    if proc.returncode != 0:
        lines.append(f"FAILED (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    return lines, summary, proc.returncode


def machine() -> str:
    mem = psutil.virtual_memory().total / 1024**3
    return f"{platform.machine()}, {os.cpu_count()} cores, {mem:.0f} GiB, Python {platform.python_version()}"


def write_markdown(path: str, results: list[tuple[str, str, str, list[str], dict | None]], quick: bool) -> None:
    day = datetime.date.today().isoformat()
    out = [
        "# Benchmarks",
        "",
        f"Latest figures, {day}, on {machine()} (no GPU). Every ratio is against a baseline "
        "measured in the same run. Produced by:",
        "",
        "```",
        "make bench        # = .venv/bin/python bench/run_all.py --write" + (" --quick" if quick else ""),
        "```",
        "",
        "Each benchmark can also be run alone: `.venv/bin/python bench/<name>.py [--quick]`.",
        "",
    ]
    for script, title, note, lines, summary in results:
        out += [f"## {title}", "", f"`bench/{script}`", "", "```"] + lines + ["```", ""]
        out += [note, ""] if note else []
        if summary:
            out += ["<details><summary>JSON</summary>", "", "```json", json.dumps(summary), "```", "", "</details>", ""]
    with open(path, "w") as handle:
        handle.write("\n".join(out))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run at MiB sizes")
    parser.add_argument("--write", action="store_true", help="replace BENCHMARKS.md with this run's figures")
    parser.add_argument("--only", default=None, help="run only the benchmarks whose file name contains this")
    args = parser.parse_args()
    results, failed = [], 0
    for script, title, note in BENCHES:
        if args.only and args.only not in script:
            continue
        print(f"running {script} ...", flush=True)
        lines, summary, code = run_one(script, args.quick)
        print("\n".join(lines), flush=True)
        failed += code != 0
        results.append((script, title, note, lines, summary))
    if args.write:
        write_markdown(os.path.join(REPO, "BENCHMARKS.md"), results, args.quick)
        print("BENCHMARKS.md written")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
