"""The executor beside diffusers' group offloading, accelerate's disk_offload and a whole load, in one run.

One synthetic bf16 model (64 blocks, 2 GiB by default: the executor's benchmark's) and
one memory cgroup size for every way: half the model in page cache plus the child's own
margin (bench_executor's rule), the group well under the model. Each way runs in a fresh
child (``python -m planners.executor.trial --mode ...``, one compute thread) that sets up
before it joins the group, so the group is charged only for the passes:

- executor: ``planners.execute`` with the plan (kept set, read-ahead, release);
- group offloading: diffusers' ``apply_group_offloading`` at block level, one block per
  group, onload device the CPU, ``offload_to_disk_path`` (its only form that keeps a model
  larger than host memory off anonymous memory): each group from a file of its own;
- disk_offload: accelerate's, execution device the CPU, its memmaps in the bench's folder;
- whole load: every weight an anonymous copy, what model CPU offload holds on the host:
  it does not fit the group, and the kernel's OOM killer ends it (the group's kills).

The offloaders' copies are written at setup (counted in their start) and their page cache
dropped, as the checkpoint's is. Per way: seconds per warm pass (median after the first),
bytes read from disk per pass (/proc/self/io), the group's peak anonymous memory (hostmem's
peak tracker on the group, every 1 ms), seconds from a loaded model to the first pass, OOM
kills; and whether the first pass's output equals a plain run's bit for bit (every way's
digest the same). Ratios are executor / each way, from this run.

    .venv/bin/python bench/bench_offloading.py            # 2 GiB model, 1 GiB of page cache
    .venv/bin/python bench/bench_offloading.py --quick    # 256 MiB smoke run
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

from common import bench_args, format_size, report, workdir  # noqa: E402  (common puts the repo on sys.path)

from bench_executor import LAYERS, PASSES, anon_margin, synthetic_checkpoint, warm  # noqa: E402
from hostmem.cgroup_sandbox import can_nest_memory_cgroup, memory_cgroup  # noqa: E402
from hostmem.peak import PeakTracker  # noqa: E402

WAYS = {
    "executor": "executor (hostmem mapping)",
    "group": "diffusers group offloading (block, disk)",
    "disk": "accelerate disk_offload",
    "whole": "whole load (model CPU offload's host copy)",
}
CHILD_TIMEOUT_S = 1800


def _child(checkpoint: str, mode: str, room: int, group) -> tuple[subprocess.CompletedProcess, dict]:
    """Run one way in a fresh child inside ``group``; returns the process and the group's anonymous peak."""
    cmd = [sys.executable, "-m", "planners.executor.trial", checkpoint, "--mode", mode, "--room", str(room),
           "--passes", str(PASSES), "--join", group.path] + (["--check-first"] if mode != "whole" else [])
    tracker = PeakTracker(reset_hwm=False, group=group).prepare()
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        tracker.start(proc.pid)
        try:
            out, err = proc.communicate(timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            group.kill_all()
            proc.communicate()
            raise SystemExit(f"{mode} child ran past {CHILD_TIMEOUT_S} s") from None
    finally:
        tracker.stop()
    peak = {"peak_anon": tracker.figures().peak_bytes, "max_gap_s": tracker.figures().max_gap_s}
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), peak


def run_way(checkpoint: str, mode: str, room: int) -> dict:
    """One way's figures; a child the OOM killer ended reports its kills and peak, not a time."""
    with memory_cgroup(room + anon_margin(os.path.getsize(checkpoint))) as group:
        done, peak = _child(checkpoint, mode, room, group)
        kills = group.oom_kills()
    for left in glob.glob(os.path.join(os.path.dirname(checkpoint), f"offload-{mode}-*")):
        shutil.rmtree(left, ignore_errors=True)  # a killed child leaves its copies behind
    if done.returncode != 0 and not kills:
        raise SystemExit(f"{mode} child failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout) if done.returncode == 0 else {"mode": mode, "returncode": done.returncode}
    return {**result, **peak, "oom_kills": kills, "limit_bytes": group.limit_bytes}


def main() -> None:
    args = bench_args(__doc__.splitlines()[0], "2GiB", "256MiB")
    reason = can_nest_memory_cgroup()
    if reason is not None:
        raise SystemExit(f"bench_offloading needs a nested memory cgroup: {reason}")
    tmp = workdir(args)
    try:
        checkpoint = synthetic_checkpoint(args)
        size = os.path.getsize(checkpoint)
        runs = {mode: run_way(checkpoint, mode, size // 2) for mode in WAYS}
    finally:
        if tmp is not None:
            tmp.cleanup()
    wrong = _report(runs, size)
    if wrong:
        raise SystemExit(f"outputs differ from a plain run's: {', '.join(wrong)}")


def _figures(run: dict) -> dict | None:
    """A finished way's figures (None for one the OOM killer ended)."""
    if "passes" not in run:
        return None
    return {"seconds_per_pass": warm(run, "seconds"), "read_bytes_per_pass": warm(run, "read_bytes"),
            "start_s": run["setup_s"] + run["start_s"], "copy_bytes": run["copy_bytes"]}


def _way_line(mode: str, run: dict, fig: dict | None, same: bool) -> str:
    head = f"{WAYS[mode]:44s}"
    tail = f"peak anon {format_size(run['peak_anon']):>10s}, OOM kills {run['oom_kills']}"
    if fig is None:
        return f"{head} OOM-killed (exit {run['returncode']}): {tail}"
    check = "output = plain run" if same else "OUTPUT DIFFERS from a plain run"
    return (f"{head} {fig['seconds_per_pass']:7.3f} s/pass, read {format_size(fig['read_bytes_per_pass']):>10s}/pass, "
            f"start {fig['start_s']:6.3f} s, {tail}; {check}")


def _report(runs: dict, size: int) -> list[str]:
    """Print the lines and the JSON; return the ways whose output differs from a plain run's."""
    limit, digest = runs["executor"]["limit_bytes"], runs["executor"].get("first_output")
    lines = [f"model {format_size(size)} in {LAYERS} blocks; every way in a fresh child in a memory cgroup of "
             f"{format_size(limit)} ({format_size(size // 2)} of page cache + {format_size(limit - size // 2)}); "
             f"{PASSES - 1} warm passes, median; start = from a loaded model to the first pass "
             "(the plan and hooks; the offloaders' writing of their copies)"]
    summary = {"model_bytes": size, "limit_bytes": limit, "layers": LAYERS, "passes": PASSES, "ways": {}}
    wrong = []
    for mode, run in runs.items():
        fig = _figures(run)
        same = fig is not None and run["identical"] is not False and run["first_output"] == digest
        if fig is not None and not same:
            wrong.append(mode)
        lines.append(_way_line(mode, run, fig, same))
        summary["ways"][mode] = {**(fig or {}), "peak_anon_bytes": run["peak_anon"], "oom_kills": run["oom_kills"],
                                 "output_equals_plain_run": same if fig is not None else None,
                                 "killed": fig is None, "sampler_max_gap_s": run["max_gap_s"]}
    lines += _ratio_lines(summary["ways"])
    summary["ratios"] = {mode: way.pop("ratios") for mode, way in summary["ways"].items() if "ratios" in way}
    report("offloading", lines, summary)
    return wrong


def _ratio_lines(ways: dict) -> list[str]:
    """executor / each way that finished, time and bytes read per pass; adds them to ``ways``."""
    ex, lines = ways["executor"], []
    if ex.get("killed", True):
        return ["executor OOM-killed: no ratios"]
    for mode, way in ways.items():
        if mode == "executor" or way["killed"]:
            continue
        way["ratios"] = {"time": ex["seconds_per_pass"] / way["seconds_per_pass"],
                         "read_bytes": ex["read_bytes_per_pass"] / max(way["read_bytes_per_pass"], 1)}
        lines.append(f"  executor / {WAYS[mode]}: time {way['ratios']['time']:.2f}x, "
                     f"bytes read {way['ratios']['read_bytes']:.2f}x")
    return lines


if __name__ == "__main__":
    main()
