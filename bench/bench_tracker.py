"""CPU overhead of the peak tracker at its default interval (1 ms).

A CPU-bound pure-Python loop is timed with and without a running tracker, in pairs
whose order alternates, in one run; the ratio is the median of the per-pair ratios
(tracked / untracked), printed with its quartiles so that noise from other jobs on
the machine is visible, for wall-clock time and for the loop's own CPU time. Goal:
under 1.02. The tracker samples from its own process, so
on an idle second core it should cost the loop nothing; the second figure keeps the
other core busy too (a CPU hog started here), so that the sampler must take its time
from the loop's core or the hog's.

    flock /tmp/hostmem-bench.lock .venv/bin/python bench/bench_tracker.py            # 40 pairs of 0.2 s
    .venv/bin/python bench/bench_tracker.py --quick                                   # 10 pairs of 0.05 s
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from common import report

from hostmem.peak import DEFAULT_INTERVAL_S, PeakTracker

GOAL = 1.02


def cpu_loop(n: int) -> int:
    """Pure-Python arithmetic: holds the GIL and one core for the whole run."""
    total = 0
    for i in range(n):
        total += (i * i) % 7
    return total


def calibrate(seconds: float) -> int:
    """The loop length that takes about ``seconds`` here."""
    n = 100_000
    while True:
        start = time.perf_counter()
        cpu_loop(n)
        took = time.perf_counter() - start
        if took > 0.05:
            return max(1, int(n * seconds / took))
        n *= 4


def timed_loop(n: int, tracker: PeakTracker | None) -> tuple[float, float]:
    """(wall, CPU) seconds of one loop; a tracker samples the whole loop, only the loop is timed."""
    if tracker is not None:
        tracker.start()
    # Both loops start after the same pause: starting the tracker sleeps ~20 ms, and a
    # process that has just slept is favoured by the scheduler, which would flatter it.
    time.sleep(0.05)
    wall, cpu = time.perf_counter(), time.thread_time()
    cpu_loop(n)
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    if tracker is not None:
        tracker.stop()
    return wall, cpu


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4)
    return q[0], statistics.median(values), q[2]


def measure(n: int, pairs: int) -> dict:
    """Alternate untracked/tracked pairs; return the ratios' quartiles and the sampler's cost.

    The wall-clock ratio is what the loop feels; the CPU-time ratio (the loop's own
    thread time) is the same question with other jobs' scheduling noise taken out.
    """
    wall_ratios, cpu_ratios, plain, samplers = [], [], [], []
    for i in range(pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        took = {}
        for with_tracker in order:
            tracker = PeakTracker() if with_tracker else None
            took[with_tracker] = timed_loop(n, tracker)
            if tracker is not None:
                samplers.append(tracker.figures())
        plain.append(took[False][0])
        wall_ratios.append(took[True][0] / took[False][0])
        cpu_ratios.append(took[True][1] / took[False][1])
    sampled_s = sum(f.duration_s for f in samplers)
    return {
        "wall": quartiles(wall_ratios),
        "cpu": quartiles(cpu_ratios),
        "untracked_s": statistics.median(plain),
        "samples_per_s": sum(f.samples for f in samplers) / sampled_s,
        "sampler_cpu_fraction": sum(f.sampler_cpu_s for f in samplers) / sampled_s,
        "max_gap_ms": max(f.max_gap_s for f in samplers) * 1000,
        "sampler_priority": samplers[-1].sampler_priority,
    }


def with_cpu_hog(fn, *args):
    """Run ``fn`` while a busy process keeps another core occupied; end the hog after."""
    hog = subprocess.Popen([sys.executable, "-I", "-S", "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        return fn(*args)
    finally:
        hog.kill()
        hog.wait()


def ratio_text(q: tuple[float, float, float]) -> str:
    return f"{q[1]:.4f} (quartiles {q[0]:.3f}-{q[2]:.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 10 pairs of 0.05 s loops")
    args = parser.parse_args()
    pairs, seconds = (10, 0.05) if args.quick else (40, 0.2)
    n = calibrate(seconds)
    PeakTracker().start().stop()  # warm: the first start loads the sampler interpreter and program from disk
    idle = measure(n, pairs)
    busy = with_cpu_hog(measure, n, pairs)
    lines = [
        f"interval {DEFAULT_INTERVAL_S * 1000:g} ms, {pairs} pairs of a {idle['untracked_s']:.3f} s CPU-bound loop, "
        f"ratios tracked/untracked (goal < {GOAL})",
        f"second core idle: wall {ratio_text(idle['wall'])}, loop CPU {ratio_text(idle['cpu'])}",
        f"  sampler: {idle['samples_per_s']:.0f} samples/s, {idle['sampler_cpu_fraction'] * 100:.1f}% of a core, "
        f"longest gap {idle['max_gap_ms']:.1f} ms, priority {idle['sampler_priority']}",
        f"second core busy: wall {ratio_text(busy['wall'])}, loop CPU {ratio_text(busy['cpu'])}",
        f"  sampler: {busy['samples_per_s']:.0f} samples/s, longest gap {busy['max_gap_ms']:.1f} ms",
    ]
    summary = {
        "interval_s": DEFAULT_INTERVAL_S,
        "pairs": pairs,
        "loop_s": round(idle["untracked_s"], 4),
        "ratio": round(idle["wall"][1], 4),
        "ratio_quartiles": [round(idle["wall"][0], 4), round(idle["wall"][2], 4)],
        "ratio_cpu": round(idle["cpu"][1], 4),
        "goal_ratio": GOAL,
        "within_goal": idle["wall"][1] < GOAL,
        "samples_per_s": round(idle["samples_per_s"], 1),
        "sampler_cpu_fraction": round(idle["sampler_cpu_fraction"], 4),
        "max_gap_s": round(idle["max_gap_ms"] / 1000, 4),
        "sampler_priority": idle["sampler_priority"],
        "ratio_second_core_busy": round(busy["wall"][1], 4),
        "ratio_cpu_second_core_busy": round(busy["cpu"][1], 4),
        "max_gap_s_second_core_busy": round(busy["max_gap_ms"] / 1000, 4),
    }
    report("tracker_overhead", lines, summary)


if __name__ == "__main__":
    main()
