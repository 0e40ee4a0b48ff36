"""`hostmem demo`: a scale too large refused (a relative --workdir is tested on the one
demo run of tests/planners/test_demo.py).

A scale larger than the free disk or memory must be refused with the figures before the
first byte is written.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from planners.demo.room import RUNTIME_ALLOWANCE, check_room, demo_needs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1024 * 1024


def _hostmem(cwd, *argv, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planners.cli", *argv], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, env={**os.environ, "PYTHONPATH": REPO})


def test_a_scale_larger_than_the_machine_is_refused_before_anything_is_written(tmp_path):
    done = _hostmem(tmp_path, "demo", "--scale", "1PB", "--workdir", "out/demo", timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    line = done.stderr.strip()
    assert line.startswith("hostmem: error: --scale 909.5 TiB: the demo needs ") and "of disk under" in line
    assert "nothing was written" in line and "Choose --scale" in line
    assert not (tmp_path / "out").exists()


def test_the_room_check_names_memory_alone_and_the_largest_scale_that_fits(tmp_path):
    disk, memory = demo_needs(256 * MiB)
    assert disk > 256 * MiB and memory > RUNTIME_ALLOWANCE
    check_room(256 * MiB, str(tmp_path), available_memory=memory)  # exactly enough: no refusal
    with pytest.raises(ValueError) as refused:
        check_room(256 * MiB, str(tmp_path), available_memory=memory - 1)
    said = str(refused.value)
    assert "of memory for the in-place start" in said and "of disk" not in said


def test_a_folder_with_no_room_for_the_smallest_demo_is_not_told_a_scale_the_demo_refuses(tmp_path):
    done = _hostmem(tmp_path, "demo", "--scale", "64MiB", "--workdir", "/proc/demo", timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    line = done.stderr.strip()
    assert "nothing was written" in line and "--workdir on a larger (and writable) disk" in line, line
    assert "Choose --scale" not in line, line
