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
    ("bench_lora.py", "LoRA merge cache: first start against peft, build throughput, start time, in place",
     "Baselines of the same run: peft's merge_and_unload of the same model, loaded as safetensors "
     "hands it over (first start and in-place path); the faster of a buffered and an O_DIRECT "
     "write (into blocks allocated up front, from a buffer on huge pages) of the same bytes (the "
     "build), run in five rounds in a rotating order, the build judged against the same round's raw "
     "write; the arithmetic alone, with the kernel the build chose; and the CPU's bound, the CPU "
     "time of the arithmetic and of the write path over the cores (summing and writing share the "
     "cores). The build is judged against the tightest of the three (the verdict line names it). "
     "Each layer's kernel (torch's "
     "bf16 addmm in one pass, or the fp32 sum in row blocks then one cast) is chosen by timing both on "
     "this machine once and remembered under the cache root; the key names it. The build streams each "
     "layer to disk while it is summed, through one output buffer on 2 MiB pages that the next layer "
     "reuses stretch by stretch once written, one writer per build keeping pieces of consecutive layers "
     "in flight; the summing threads run at the process's own priority. Each build round starts from "
     "a cache emptied of combinations with the base's digests remembered (any build after the first on "
     "a base); the first start begins from an empty root, so it also hashes the base, beside the build. "
     "'write path' is the vault storing ready layers (checksum, O_DIRECT, fsync): the cache's own "
     "cost. A virtual disk's rate swings from one minute to the next, hence the interleaved rounds. "
     "In place, each merged weight is a new tensor beside safetensors' private mapping, which is "
     "never written (peft sums into it, copying its pages on write one 4 KiB fault at a time)."),
    ("bench_lora.py", "LoRA merge cache on torch held to AVX2 (as on a CPU without AVX512-BF16 or AMX)",
     "The same benchmark at 1 GiB with torch's own kernels and oneDNN's held to AVX2 by their "
     "environment variables, on this machine: torch's bf16 addmm then takes tens of times longer "
     "than the fp32 sum, as on a CPU that has AVX2 alone, and the kernel timing picks the fp32 sum "
     "(the timings are kept apart under these caps). The disk, memory and cores are this machine's.",
     ["--size", "1GiB"], {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}),
    ("bench_first_pass.py", "First start to first image: the latest run of bench_first_pass",
     "Each way a server starts, in a fresh process, the page cache of its inputs dropped before each "
     "start and every file read around it (so all come from the same place), then one pass over every "
     "weight: the miss (digests remembered), a new base (its hash folded into the build), the in-place "
     "merge, the hit, no LoRA. Three rounds in a rotating order, medians; the regime of starts right "
     "after their drop. The section 'First start to first image: a start plus the first pass' below "
     "tells how each figure came about.", ["--right-after-drop"], {}),
    ("bench_identity.py", "Content identity: hashing the inputs, hit starts, a cache baked read-only",
     "The identity hash and the raw read both start from a cold page cache. The baked start maps a "
     "copy of the base (new inode and times, so its digest is computed once) and a cache in a "
     "read-only bind mount, and is judged against a build of the same cache."),
    ("bench_diffusers.py", "With diffusers: fuse_lora, peft and the cache on one transformer",
     "A shallow Flux transformer at Flux's width; each contender in a fresh process under the peak "
     "tracker. The hit's growth is what a server pays on every start after the first; the first "
     "start holds one layer's merge buffers by design."),
    ("bench_switch.py", "Switching adapters: cached, at run time, against peft and diffusers", ""),
    ("bench_shared_build.py", "Several ranks on one host: one merged copy, a build they share",
     "On 2 cores one rank alone already keeps both cores busy most of its time (the CPU's bound line), "
     "so the ranks of a shared build share the same cores and pay for four processes: its gain grows "
     "with a core or a GPU per rank, until the disk bounds the build (the disk's bound line)."),
    ("bench_vault_hit.py", "A cache hit in the vault: open, map every layer, close", ""),
    ("bench_executor.py", "Executor: a model twice its page cache, against the kernel's own reads",
     "A synthetic bf16 model mapped read-only, run in a nested memory cgroup that leaves it half the "
     "model in page cache: under the executor, left to the kernel's fault-driven reads, and with the "
     "model in page cache (the compute bound); the disk bound is the executor's bytes read at the "
     "checkpoint's sequential read rate, measured just before and just after each mapping's executor "
     "trial (the mean of the two). Needs a memory cgroup this process "
     "may nest under its own."),
    ("bench_offloading.py", "Executor beside diffusers' group offloading, accelerate's disk_offload and a whole load",
     "The executor's synthetic model and memory cgroup (half the model in page cache), each way in a fresh child "
     "that sets up before it joins the group: diffusers' group offloading at block level to disk and accelerate's "
     "disk_offload with the CPU as their device (their copies written at setup, counted in their start, their "
     "page cache then dropped), and the whole model as anonymous memory (what model CPU offload holds on the "
     "host), which the group's OOM killer ends. Peak anonymous memory is the group's, sampled every 1 ms by "
     "hostmem's peak tracker. Needs a memory cgroup this process may nest under its own."),
    ("bench_cli.py", "Light commands: start-up against `python -c pass`", ""),
)


def command_line(script: str, args: list[str], env: dict[str, str]) -> str:
    """How to run one benchmark by hand, as its section of BENCHMARKS.md names it."""
    return " ".join([*(f"{k}={v}" for k, v in env.items()), f"bench/{script}", *args])


def run_one(script: str, quick: bool, args: list[str], env: dict[str, str]) -> tuple[list[str], dict | None, int]:
    """Run one benchmark; return its readable lines, its JSON summary and its exit code."""
    command = [sys.executable, os.path.join(HERE, script)] + (["--quick"] if quick else args)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **env)
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
    """The machine every figure below was measured on: CPU model and the flags that decide the
    merge's kernels, cores, memory, torch, Python, and the disk the benchmarks write to."""
    sys.path.insert(0, HERE)
    from common import machine_line, machine_summary

    mem = psutil.virtual_memory().total / 1024**3
    found = machine_summary(os.environ.get("TMPDIR", "/var/tmp"))
    return f"{machine_line(found)}, {platform.machine()}, {mem:.0f} GiB, Python {platform.python_version()}"


def _section(command: str, title: str, note: str, lines: list[str], summary: dict | None) -> list[str]:
    out = [f"## {title}", "", f"`{command}`", "", "```"] + lines + ["```", ""]
    out += [note, ""] if note else []
    if summary:
        out += ["<details><summary>JSON</summary>", "", "```json", json.dumps(summary), "```", "", "</details>", ""]
    return out


def replace_sections(path: str, results: list[tuple[str, str, str, list[str], dict | None]]) -> None:
    """Rewrite only the given benchmarks' sections of BENCHMARKS.md (``--only`` with ``--write``),
    each under its own ``## title``, the rest of the file as it was; a section not there is added."""
    with open(path) as handle:
        text = handle.read()
    for command, title, note, lines, summary in results:
        body = "\n".join(_section(command, title, note, lines, summary))
        start = text.find(f"## {title}\n")
        if start < 0:
            text = text.rstrip("\n") + "\n\n" + body
            continue
        end = text.find("\n## ", start + 1)
        text = text[:start] + body + ("\n" + text[end + 1:] if end >= 0 else "")
    with open(path, "w") as handle:
        handle.write(text)


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
    for result in results:
        out += _section(*result)
    with open(path, "w") as handle:
        handle.write("\n".join(out))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run at MiB sizes")
    parser.add_argument("--write", action="store_true", help="replace BENCHMARKS.md with this run's figures")
    parser.add_argument("--only", default=None, help="run only the benchmarks whose file name or title contains "
                        "this (with --write: replace only their sections of BENCHMARKS.md)")
    args = parser.parse_args()
    results, failed = [], 0
    for script, title, note, *how in BENCHES:
        if args.only and args.only not in script and args.only not in title:
            continue
        options, env = how or ([], {})
        command = command_line(script, options, env)
        print(f"running {command} ...", flush=True)
        lines, summary, code = run_one(script, args.quick, options, env)
        print("\n".join(lines), flush=True)
        failed += code != 0
        results.append((command, title, note, lines, summary))
    if args.write and args.only:
        replace_sections(os.path.join(REPO, "BENCHMARKS.md"), results)
        print("BENCHMARKS.md: the sections of this run replaced")
    elif args.write:
        write_markdown(os.path.join(REPO, "BENCHMARKS.md"), results, args.quick)
        print("BENCHMARKS.md written")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
