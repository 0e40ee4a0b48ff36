"""The executor against the kernel's own reads, on a model larger than its memory cgroup.

A synthetic bf16 model (64 blocks, 2 GiB by default) runs forward passes in a child that
joins a memory cgroup leaving it half the model in page cache (``python -m
planners.executor.trial``, one compute thread), on both mappings users have: hostmem's
(read-only, shared, huge pages asked for) and safetensors' own (``load_file``: private,
writable, 4 KiB pages). On each, side by side in one run:

- executor: the plan's kept set read once, the rest read ahead and released;
- kernel: the same passes, same group, left to the kernel's fault-driven reads (LRU
  against a cyclic scan: every page evicted just before its reuse);
- disk bound: the executor's bytes read per pass at the rate its reader re-reads the
  checkpoint (four threads faulting 2 MiB folios of 32 MiB layers, pages dropped first:
  :func:`planners.executor.rates.reader_rate`), measured just before and just after that
  mapping's executor trial, the mean of the two: a virtual disk's rate swings by 2x from
  one minute to the next, so a rate taken once for the whole run judges each trial by
  another minute's disk. The bound at the disk's large sequential preads, which no
  mapping's faults reach, is printed beside it.

- compute bound: the same passes with the model in page cache (no group), on the same
  mapping (a private mapping is mapped in 4 KiB page-table entries, hostmem's in 2 MiB
  ones: the same matmuls take longer on the first).

And once: the executor on hostmem's mapping with ``max_pinned: 75%`` (pins take what the
window leaves).

Figures are medians over the warm passes (after the first). Floors, on each mapping:
time per pass <= 0.8 of the kernel's, bytes read per pass <= 0.7 of the kernel's and
within 10% of the plan's prediction (the released layers), time per pass <= 1.25 of the
larger of the two bounds; with 75% pins, bytes read within 10% of the plan's.

    .venv/bin/python bench/bench_executor.py               # 2 GiB model, 1 GiB of page cache
    .venv/bin/python bench/bench_executor.py --quick       # 256 MiB smoke run (layers of 4 MiB: smaller ones are mostly 2 MiB folio edges)
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
from planners.executor.rates import measure_file, reader_rate  # noqa: E402
from planners.executor.synthetic import LOADERS, write_synthetic_dit  # noqa: E402

LAYERS, PASSES = 64, 5


def _trial(checkpoint: str, mode: str, room: int, group: str | None, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "planners.executor.trial", checkpoint, "--mode", mode, "--room", str(room),
           "--passes", str(PASSES), *extra]
    done = subprocess.run(cmd + (["--join", group] if group else []), capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{mode} child failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def anon_margin(model_bytes: int) -> int:
    """The group's room beyond the plan's page cache (the child's own growth): an eighth of the
    model, 8-48 MiB, so that the group stays well under the model."""
    return max(8 << 20, min(48 << 20, model_bytes // 8))


def _in_group(checkpoint: str, mode: str, room: int, *extra: str) -> dict:
    with memory_cgroup(room + anon_margin(os.path.getsize(checkpoint))) as group:
        result = _trial(checkpoint, mode, room, group.path, *extra)
        result["oom_kills"] = group.oom_kills()
    return result


def warm(result: dict, key: str) -> float:
    """The median of ``key`` over a trial's warm passes (after the first)."""
    return statistics.median(p[key] for p in result["passes"][1:])


def synthetic_checkpoint(args) -> str:
    """The synthetic model of ``args.size_bytes`` in :data:`LAYERS` blocks, written under ``args.workdir``."""
    d = int(math.sqrt(args.size_bytes / LAYERS / 2))
    return write_synthetic_dit(os.path.join(args.workdir, "dit.safetensors"), LAYERS, d)


def main() -> None:
    args = bench_args(__doc__.splitlines()[0], "2GiB", "256MiB")
    reason = can_nest_memory_cgroup()
    if reason is not None:
        raise SystemExit(f"bench_executor needs a nested memory cgroup: {reason}")
    tmp = workdir(args)
    runs = {}
    try:
        checkpoint = synthetic_checkpoint(args)
        room = os.path.getsize(checkpoint) // 2
        disk_rates = {}
        for loader in LOADERS:
            before = _disk_rates(checkpoint)
            runs[loader] = {"executor": _in_group(checkpoint, "executor", room, "--loader", loader)}
            disk_rates[loader] = {way: (before[way], rate) for way, rate in _disk_rates(checkpoint).items()}
            runs[loader]["kernel"] = _in_group(checkpoint, "kernel", room, "--loader", loader)
            runs[loader]["cached"] = _trial(checkpoint, "cached", room, None, "--loader", loader)
        pinned = _in_group(checkpoint, "executor", room, "--max-pinned", "75%")
        size = os.path.getsize(checkpoint)
    finally:
        if tmp is not None:
            tmp.cleanup()
    _report(runs, pinned, disk_rates, size)


def _disk_rates(checkpoint: str) -> dict[str, float]:
    """The checkpoint's rates now, bytes/s: ``readers``, the executor's own reader re-reading it
    (four threads faulting 2 MiB folios: the bound's rate), and ``sequential``, large preads."""
    return {"readers": reader_rate(checkpoint), "sequential": measure_file(checkpoint)[1]}


def _floors(executor, kernel, t_c, disk_rate, sequential_rate) -> dict:
    t_ex, t_k = warm(executor, "seconds"), warm(kernel, "seconds")
    r_ex, r_k = warm(executor, "read_bytes"), warm(kernel, "read_bytes")
    predicted = executor["predicted_read_bytes"]
    return {
        "time_vs_kernel": (t_ex / t_k, 0.8),
        "read_vs_kernel": (r_ex / max(r_k, 1), 0.7),
        "read_vs_plan": (abs(r_ex - predicted) / predicted if predicted else 0.0, 0.1),
        "time_vs_bound": (t_ex / max(r_ex / disk_rate, t_c), 1.25),
        "time_vs_sequential_bound": (t_ex / max(r_ex / sequential_rate, t_c), None),
    }


def _mark(value: float, goal: float | None) -> str:
    return "" if goal is None or value <= goal else "  over the floor"


def _loader_lines(loader, executor, kernel, cached, floors, rates) -> list[str]:
    disk_rate, sequential = (statistics.fmean(rates[way]) for way in ("readers", "sequential"))
    before, after = rates["readers"]
    t_ex, t_k = warm(executor, "seconds"), warm(kernel, "seconds")
    r_ex, r_k = warm(executor, "read_bytes"), warm(kernel, "read_bytes")
    roles = executor["executor"]["roles"]["dit"]
    f = {k: (v, _mark(v, goal)) for k, (v, goal) in floors.items()}
    return [
        f"{loader} mapping: kept {roles['kept']} blocks, released {roles['released']}; reader "
        f"{executor['executor']['reader']}, chosen and hooked in {executor['start_s'] * 1000:.1f} ms at start "
        f"(goal < 50 ms){_mark(executor['start_s'], 0.05)}",
        f"  executor   {t_ex:6.3f} s/pass  read {format_size(r_ex)}/pass  (plan: "
        f"{format_size(executor['predicted_read_bytes'])}, off by {f['read_vs_plan'][0]:.1%}, goal <= 10%)"
        f"{f['read_vs_plan'][1]}",
        f"  kernel     {t_k:6.3f} s/pass  read {format_size(r_k)}/pass",
        f"    executor/kernel: time {f['time_vs_kernel'][0]:.2f}x (goal <= 0.8){f['time_vs_kernel'][1]}, "
        f"bytes read {f['read_vs_kernel'][0]:.2f}x (goal <= 0.7){f['read_vs_kernel'][1]}",
        f"    executor/bound: {f['time_vs_bound'][0]:.2f}x (goal <= 1.25){f['time_vs_bound'][1]}; disk bound "
        f"{r_ex / disk_rate:.3f} s/pass ({format_size(r_ex)} at the reader's {format_size(disk_rate)}/s, the "
        f"mean of {format_size(before)}/s before and {format_size(after)}/s after), compute bound "
        f"{warm(cached, 'seconds'):.3f} s/pass (model in page cache, this mapping)",
        f"    against the disk's large preads instead ({format_size(sequential)}/s): "
        f"{f['time_vs_sequential_bound'][0]:.2f}x the bound",
        f"    the pass's own thread ran (CPU) {warm(executor, 'cpu_seconds'):.3f} s/pass under the executor, "
        f"{warm(cached, 'cpu_seconds'):.3f} s/pass with the model in page cache: the rest of a pass is waiting",
        f"  OOM kills: executor {executor['oom_kills']}, kernel {kernel['oom_kills']}; group limit hits: executor "
        f"{executor['passes'][-1]['cgroup']['limit_hits']}, kernel {kernel['passes'][-1]['cgroup']['limit_hits']}",
    ]


def _pinned_lines(pinned) -> tuple[list[str], float]:
    r_p, predicted = warm(pinned, "read_bytes"), pinned["predicted_read_bytes"]
    off = abs(r_p - predicted) / predicted if predicted else 0.0
    roles = pinned["executor"]["roles"]["dit"]
    return [f"max_pinned 75% (hostmem mapping): pinned {roles['pinned']} blocks ({format_size(pinned['pinned_bytes'])}), "
            f"window {format_size(pinned['window_bytes'])} left, kept {roles['kept']}, released {roles['released']}; "
            f"{warm(pinned, 'seconds'):.3f} s/pass, read {format_size(r_p)}/pass (plan: {format_size(predicted)}, "
            f"off by {off:.1%}, goal <= 10%){_mark(off, 0.1)}; group limit hits "
            f"{pinned['passes'][-1]['cgroup']['limit_hits']}"], off


def _report(runs, pinned, disk_rates, size) -> None:
    lines = [f"model {format_size(size)} in {LAYERS} blocks; group leaves {format_size(size // 2)} of page cache "
             f"(+{format_size(anon_margin(size))}); {PASSES - 1} warm passes, median"]
    summary = {"model_bytes": size, "room_bytes": size // 2, "layers": LAYERS, "passes": PASSES,
               "mappings": {}}
    for loader, run in runs.items():
        disk_rate, sequential = (statistics.fmean(disk_rates[loader][way]) for way in ("readers", "sequential"))
        floors = _floors(run["executor"], run["kernel"], warm(run["cached"], "seconds"), disk_rate, sequential)
        lines += _loader_lines(loader, run["executor"], run["kernel"], run["cached"], floors, disk_rates[loader])
        summary["mappings"][loader] = {
            "disk_read_rate": disk_rate, "sequential_read_rate": sequential,
            "disk_read_rates_before_after": {way: list(r) for way, r in disk_rates[loader].items()},
            "seconds_per_pass": {m: warm(r, "seconds") for m, r in run.items()},
            "cpu_seconds_per_pass": {m: warm(r, "cpu_seconds") for m, r in run.items()},
            "read_bytes_per_pass": {**{m: warm(r, "read_bytes") for m, r in run.items()},
                                    "plan": run["executor"]["predicted_read_bytes"]},
            "roles": run["executor"]["executor"]["roles"]["dit"], "reader": run["executor"]["executor"]["reader"],
            "ratios": {k: v for k, (v, _) in floors.items()}, "start_s": run["executor"]["start_s"],
            "limit_hits": {m: r["passes"][-1]["cgroup"]["limit_hits"] for m, r in run.items() if m != "cached"},
        }
    pinned_lines, off = _pinned_lines(pinned)
    lines += pinned_lines
    summary["max_pinned_75"] = {"read_bytes_per_pass": warm(pinned, "read_bytes"), "seconds_per_pass":
                                warm(pinned, "seconds"), "plan": pinned["predicted_read_bytes"], "read_vs_plan": off,
                                "pinned_bytes": pinned["pinned_bytes"], "window_bytes": pinned["window_bytes"],
                                "roles": pinned["executor"]["roles"]["dit"],
                                "limit_hits": pinned["passes"][-1]["cgroup"]["limit_hits"]}
    report("executor", lines, summary)


if __name__ == "__main__":
    main()
