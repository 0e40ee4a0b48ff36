"""`hostmem inspect` on another process, read from /proc alone."""

import json
import subprocess
import sys

import torch

from tests.conftest import write_safetensors

MiB = 1024 * 1024

CHILD = r"""
import sys, torch
from hostmem import load_readonly
weights = load_readonly(sys.argv[1])
for t in weights.values():
    float(t.float().sum())           # fault every mapped page in
scratch = torch.empty(128 * 1024 * 1024, dtype=torch.uint8).fill_(7)
print(scratch.data_ptr(), scratch.data_ptr() + scratch.nbytes, flush=True)
sys.stdin.readline()
"""


def _overlap(mapping, start, end):
    return max(0, min(mapping["end"], end) - max(mapping["start"], start))


def test_inspect_json_of_a_child_holding_mapped_and_anonymous_memory(tmp_path):
    path = write_safetensors(
        tmp_path / "weights.safetensors",
        {f"blocks.{i}.weight": torch.ones(1024, 8192, dtype=torch.float32) for i in range(8)},
    )  # 8 x 32 MiB = 256 MiB
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        start, end = (int(x) for x in child.stdout.readline().split())
        out = subprocess.run(
            [sys.executable, "-m", "planners.cli", "inspect", "--pid", str(child.pid), "--json"],
            capture_output=True, text=True, check=True,
        )
    finally:
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(timeout=30)
    report = json.loads(out.stdout)
    assert report["pid"] == child.pid and report["precision"] == "page"
    for key in ("anonymous", "file_backed", "shmem", "pinned", "swapped", "not_resident", "non_reclaimable"):
        assert isinstance(report["totals"][key], int)
    weights_maps = [m for m in report["mappings"] if m["path"] == str(path)]
    file_backed = sum(m["file_backed"] for m in weights_maps)
    assert abs(file_backed - 256 * MiB) <= 0.05 * 256 * MiB, file_backed
    assert sum(m["anonymous"] for m in weights_maps) == 0
    # The scratch tensor's area: every byte of it anonymous.
    scratch = [m for m in report["mappings"] if _overlap(m, start, end)]
    anonymous = sum(m["anonymous"] for m in scratch)
    assert abs(anonymous - 128 * MiB) <= 0.05 * 128 * MiB, anonymous
    assert report["totals"]["non_reclaimable"] >= 128 * MiB
    assert report["totals"]["file_backed"] >= 256 * MiB


def test_inspect_text_and_a_bad_pid():
    out = subprocess.run([sys.executable, "-m", "planners.cli", "inspect", "--top", "3"], capture_output=True,
                         text=True)
    assert out.returncode == 0
    assert "non-reclaimable" in out.stdout and "mapping" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "planners.cli", "inspect", "--pid", "999999999"],
                         capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr == (
        "hostmem: error: pid 999999999: no such process (it may have exited; list processes with `ps`)\n"
    )


def test_whole_areas_counted_without_torch_match_the_range_classifier(tmp_path):
    """inspect's byte histogram and the accountant's prefix sums agree page for page."""
    from hostmem.process import inspect_process
    from hostmem.residency import RangeClassifier

    path = write_safetensors(tmp_path / "w.safetensors", {"w": torch.ones(1024, 4096, dtype=torch.float32)})
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        child.stdout.readline()  # the child is idle now: its pages stay as they are
        whole = inspect_process(child.pid)
        with RangeClassifier(child.pid) as ranges:
            by_range = ranges.classify_many([(v.start, v.end) for v in ranges.vmas])
    finally:
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(timeout=30)
    assert [(m.start, m.residency) for m in whole.mappings] == [
        (v.start, r) for v, r in zip(ranges.vmas, by_range)
    ]
    assert whole.totals.anonymous >= 128 * MiB and whole.totals.file_backed >= 16 * MiB
