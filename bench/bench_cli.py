"""Start-up time of the light commands against `python -c pass`, measured side by side.

A light command (``hostmem inspect``, ``cache ls|verify|prune|rm``, ``guard``, ``plan``
from declared sizes, from a checkpoint's headers, or by path with adapters and no
``lora_targets``, ``--version``) reads a few files;
what a person waits for is the interpreter and the imports. Goal: each within 3x of a
bare interpreter (``python -c pass``). Each round starts every command once, in a
rotating order, so a busy machine slows them all alike; the figure is the median of
the rounds, and the ratio is against the bare interpreter's median of the same rounds.
It also says which commands imported torch (the one import that breaks the goal).

Modules are compiled once and their bytecode kept (in a temp folder, whatever
``PYTHONDONTWRITEBYTECODE`` says), as an installed package runs: a first, unmeasured
round warms that cache, so the figures are start-ups, not compiles.

    python bench/bench_cli.py              # 15 rounds
    python bench/bench_cli.py --rounds 5   # a quick look

Not part of bench/run_all.py: it takes seconds and writes no files outside a temp folder.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
GOAL = 3.0
PROBE = (  # main() reads sys.argv, as the ``hostmem`` console script calls it
    "import sys; from planners.cli import main\n"
    "try:\n    code = main()\nexcept SystemExit as exc:\n    code = exc.code\n"
    "sys.stderr.write('\\ntorch=%s\\n' % ('torch' in sys.modules))\n"
)


def write_checkpoint(folder: str, layers: int = 40, tensors_per_layer: int = 8) -> None:
    """A header-only-sized checkpoint: tiny U8 tensors with a real safetensors header."""
    os.makedirs(folder, exist_ok=True)
    header, at = {}, 0
    for i in range(layers):
        for j in range(tensors_per_layer):
            header[f"blocks.{i}.w{j}.weight"] = {"dtype": "U8", "shape": [16], "data_offsets": [at, at + 16]}
            at += 16
    body = json.dumps(header).encode()
    with open(os.path.join(folder, "model.safetensors"), "wb") as handle:
        handle.write(struct.pack("<Q", len(body)) + body + bytes(at))


def _write_safetensors(path: str, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors file of zero-filled tensors ``{name: (dtype, shape)}`` (no torch)."""
    sizes = {"BF16": 2, "F32": 4}
    header, at = {}, 0
    for name, (dtype, shape) in tensors.items():
        nbytes = sizes[dtype] * shape[0] * shape[1]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + nbytes]}
        at += nbytes
    body = json.dumps(header).encode()
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(body)) + body + bytes(at))


def write_adapter_deployment(work: str, layers: int = 40) -> str:
    """A checkpoint of 2-D weights, a rank-4 LoRA on one weight per block, and a config that
    names both by path without ``lora_targets``: the planner reads the targets from the adapter."""
    folder = os.path.join(work, "dit_lora")
    os.makedirs(folder, exist_ok=True)
    _write_safetensors(os.path.join(folder, "model.safetensors"),
                       {f"blocks.{i}.w{j}.weight": ("BF16", [64, 64]) for i in range(layers) for j in range(4)})
    adapter = {}
    for i in range(layers):
        adapter[f"blocks.{i}.w0.lora_A.weight"] = ("F32", [4, 64])
        adapter[f"blocks.{i}.w0.lora_B.weight"] = ("F32", [64, 4])
    _write_safetensors(os.path.join(work, "lora.safetensors"), adapter)
    config = os.path.join(work, "deploy_lora.yaml")
    with open(config, "w") as handle:
        handle.write("deployment: bench-lora\nhost: {limit: 32GiB, reserve: 4GiB}\nworkload: {steps: 4}\n"
                     "components:\n  dit: {path: dit_lora, layers: \"blocks.{i}.\", offload: layerwise}\n"
                     "lora: {adapters: [{path: lora.safetensors}], cache: {root: cache}}\n")
    return config


def commands(work: str) -> dict[str, list[str]]:
    """The light commands, as argv after ``hostmem``."""
    write_checkpoint(os.path.join(work, "dit"))
    config = os.path.join(work, "deploy.yaml")
    with open(config, "w") as handle:
        handle.write("deployment: bench\nhost: {limit: 32GiB, reserve: 4GiB}\nworkload: {steps: 4}\n"
                     "components:\n  dit: {path: dit, layers: \"blocks.{i}.\", offload: layerwise, "
                     "lora_targets: [\"blocks.*.w0.weight\"]}\n")
    root = os.path.join(work, "cache")
    os.makedirs(root, exist_ok=True)
    return {
        "--version": ["--version"],
        "inspect": ["inspect", "--top", "5"],
        "cache ls": ["cache", "ls", "--root", root],
        "cache verify": ["cache", "verify", "--root", root],
        "cache prune": ["cache", "prune", "--dry-run", "--root", root],
        "cache rm": ["cache", "rm", "0123", "--root", root],
        "guard": ["guard", "--max-peak-anon", "1GiB", "--", "true"],
        "plan (declared)": ["plan", os.path.join(REPO, "configs", "minimax-h3-32g.yaml")],
        "plan (headers)": ["plan", config, "--what-if", "in-place"],
        "plan (adapters)": ["plan", write_adapter_deployment(work)],
    }


def bytecode_env(work: str) -> dict[str, str]:
    """The environment with bytecode written to and read from ``work`` (never the tree)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = os.path.join(work, "pycache")
    return env


def start(argv: list[str] | None, env: dict[str, str]) -> tuple[float, bool]:
    """Seconds from spawn to exit, and whether torch was imported (None argv: bare python)."""
    command = [sys.executable, "-c", "pass"] if argv is None else [sys.executable, "-c", PROBE, *argv]
    began = time.perf_counter()
    out = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env)
    took = time.perf_counter() - began
    return took, argv is not None and out.stderr.rstrip().endswith("torch=True")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="starts of each command (default 15)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hostmem-bench-cli-") as work:
        named = {"python -c pass": None, **commands(work)}
        times: dict[str, list[float]] = {name: [] for name in named}
        torch_seen: dict[str, bool] = dict.fromkeys(named, False)
        names = list(named)
        env = bytecode_env(work)
        for name in names:  # warm-up: compile once, as an install does
            start(named[name], env)
        for round_ in range(args.rounds):
            for name in names[round_ % len(names):] + names[: round_ % len(names)]:
                took, imported = start(named[name], env)
                times[name].append(took)
                torch_seen[name] |= imported
    base = statistics.median(times["python -c pass"])
    print(f"== light commands: start-up against `python -c pass` ({args.rounds} rounds, median; goal <= {GOAL:.0f}x)")
    print(f"  {'python -c pass':18} {base * 1000:7.1f} ms   1.00x")
    summary = {"bench": "cli", "rounds": args.rounds, "python_s": base, "commands": {}}
    for name in names[1:]:
        median = statistics.median(times[name])
        ratio = median / base
        flag = "" if ratio <= GOAL else "  over the goal"
        flag += "  (imports torch)" if torch_seen[name] else ""
        print(f"  {name:18} {median * 1000:7.1f} ms  {ratio:5.2f}x{flag}")
        summary["commands"][name] = {"seconds": median, "ratio": ratio, "imports_torch": torch_seen[name]}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
