"""The executor against the kernel's own reads, on a model larger than its memory cgroup.

A synthetic bf16 model (64 blocks, 1 GiB by default) mapped read-only runs forward
passes in a child that joins a memory cgroup leaving it half the model in page cache
(``python -m planners.executor.trial``, one compute thread). Side by side in one run:

- executor: the plan's kept set read once, the rest read ahead and released;
- kernel: the same passes, same group, left to the kernel's fault-driven reads (LRU
  against a cyclic scan: every page evicted just before its reuse);
- compute bound: the same passes with the model in page cache (no group);
- disk bound: the executor's bytes read per pass at the disk's sequential rate, measured
  on the checkpoint in the same run (its pages dropped first).

Figures are medians over the warm passes (after the first). Floors: time per pass
<= 0.8 of the kernel's, bytes read per pass <= 0.7 of the kernel's and within 10% of
the plan's prediction (the released layers), time per pass <= 1.25 of the larger of the
two bounds.

    .venv/bin/python bench/bench_executor.py               # 1 GiB model, 512 MiB of page cache
    .venv/bin/python bench/bench_executor.py --quick       # 64 MiB smoke run
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys

from common import bench_args, format_size, report, workdir  # noqa: E402  (common puts the repo on sys.path)

from hostmem.cgroup_sandbox import can_nest_memory_cgroup, memory_cgroup  # noqa: E402
from planners.executor.rates import measure_file  # noqa: E402
from planners.executor.synthetic import write_synthetic_dit  # noqa: E402

LAYERS, PASSES = 64, 5


def _trial(checkpoint: str, mode: str, room: int, group: str | None) -> dict:
    cmd = [sys.executable, "-m", "planners.executor.trial", checkpoint, "--mode", mode, "--room", str(room),
           "--passes", str(PASSES)]
    done = subprocess.run(cmd + (["--join", group] if group else []), capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"{mode} child failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def anon_margin(model_bytes: int) -> int:
    """The group's room beyond the plan's page cache (the child's own growth): an eighth of the
    model, 8-48 MiB, so that the group stays well under the model."""
    return max(8 << 20, min(48 << 20, model_bytes // 8))


def _in_group(checkpoint: str, mode: str, room: int) -> dict:
    with memory_cgroup(room + anon_margin(os.path.getsize(checkpoint))) as group:
        result = _trial(checkpoint, mode, room, group.path)
        result["oom_kills"] = group.oom_kills()
    return result


def _warm(result: dict, key: str) -> float:
    return statistics.median(p[key] for p in result["passes"][1:])


def main() -> None:
    args = bench_args(__doc__.splitlines()[0], "1GiB", "64MiB")
    reason = can_nest_memory_cgroup()
    if reason is not None:
        raise SystemExit(f"bench_executor needs a nested memory cgroup: {reason}")
    tmp = workdir(args)
    try:
        d = int(math.sqrt(args.size_bytes / LAYERS / 2))
        checkpoint = write_synthetic_dit(os.path.join(args.workdir, "dit.safetensors"), LAYERS, d)
        room = os.path.getsize(checkpoint) // 2
        executor = _in_group(checkpoint, "executor", room)
        kernel = _in_group(checkpoint, "kernel", room)
        cached = _trial(checkpoint, "cached", room, None)
        size, disk_rate, _ = measure_file(checkpoint)
    finally:
        if tmp is not None:
            tmp.cleanup()
    _report(executor, kernel, cached, disk_rate, size)


def _report(executor, kernel, cached, disk_rate, size) -> None:
    t_ex, t_k, t_c = (_warm(r, "seconds") for r in (executor, kernel, cached))
    r_ex, r_k = _warm(executor, "read_bytes"), _warm(kernel, "read_bytes")
    predicted = executor["predicted_read_bytes"]
    disk_bound = r_ex / disk_rate
    bound = max(disk_bound, t_c)
    floors = {
        "time_vs_kernel": (t_ex / t_k, 0.8),
        "read_vs_kernel": (r_ex / max(r_k, 1), 0.7),
        "read_vs_plan": (abs(r_ex - predicted) / predicted if predicted else 0.0, 0.1),
        "time_vs_bound": (t_ex / bound, 1.25),
    }
    mark = {k: "" if v <= goal else "  over the floor" for k, (v, goal) in floors.items()}
    roles = executor["executor"]["roles"]["dit"]
    lines = [
        f"model {format_size(size)} in {LAYERS} blocks; group leaves {format_size(size // 2)} of page cache "
        f"(+{format_size(anon_margin(size))}); kept {roles['kept']} blocks, released {roles['released']}; "
        f"reader {executor['executor']['reader']}; {PASSES - 1} warm passes, median",
        f"executor   {t_ex:6.3f} s/pass  read {format_size(r_ex)}/pass  (plan: {format_size(predicted)}, "
        f"off by {floors['read_vs_plan'][0]:.1%}, goal <= 10%){mark['read_vs_plan']}",
        f"kernel     {t_k:6.3f} s/pass  read {format_size(r_k)}/pass",
        f"  executor/kernel: time {floors['time_vs_kernel'][0]:.2f}x (goal <= 0.8){mark['time_vs_kernel']}, "
        f"bytes read {floors['read_vs_kernel'][0]:.2f}x (goal <= 0.7){mark['read_vs_kernel']}",
        f"bounds     compute {t_c:.3f} s/pass (model in page cache), disk {disk_bound:.3f} s/pass "
        f"({format_size(r_ex)} at {format_size(disk_rate)}/s)",
        f"  executor/bound: {floors['time_vs_bound'][0]:.2f}x (goal <= 1.25){mark['time_vs_bound']}",
        f"OOM kills: executor {executor['oom_kills']}, kernel {kernel['oom_kills']}; group limit hits: executor "
        f"{executor['passes'][-1]['cgroup']['limit_hits']}, kernel {kernel['passes'][-1]['cgroup']['limit_hits']}",
    ]
    summary = {
        "model_bytes": size, "room_bytes": size // 2, "layers": LAYERS, "passes": PASSES,
        "seconds_per_pass": {"executor": t_ex, "kernel": t_k, "compute_bound": t_c, "disk_bound": disk_bound},
        "read_bytes_per_pass": {"executor": r_ex, "kernel": r_k, "plan": predicted},
        "disk_read_rate": disk_rate, "roles": roles, "reader": executor["executor"]["reader"],
        "ratios": {k: v for k, (v, _) in floors.items()},
        "limit_hits": {"executor": executor["passes"][-1]["cgroup"]["limit_hits"],
                       "kernel": kernel["passes"][-1]["cgroup"]["limit_hits"]},
    }
    report("executor", lines, summary)


if __name__ == "__main__":
    main()
