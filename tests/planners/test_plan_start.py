"""What ``hostmem plan`` does to start fast must not change what it prints.

The command line skips the exit collection for a read-only command run as the
program, builds argparse's help formatter without shutil, and the planners sum
residency in one pass; each is checked here against the plain way of doing it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys

import pytest

from hostmem.residency_classes import Residency
from planners.cli import build_parser, main
from planners.sizes import Layer, from_declared, sum_residency, with_residency

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join("configs", "minimax-h3-32g.yaml")


@pytest.mark.parametrize("argv", [["plan", CONFIG], ["plan", CONFIG, "--json", "--what-if", "in-place"]])
def test_the_program_prints_what_main_returns_in_process(capsys, argv):
    """``python -m planners.cli`` (the program path, exit collection skipped) prints the same report."""
    assert main(argv) == 0
    expected = capsys.readouterr().out
    out = subprocess.run([sys.executable, "-m", "planners.cli", *argv], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected and out.stderr == ""


@pytest.mark.parametrize("columns", ["57", "120", None])
def test_help_is_wrapped_as_argparse_wraps_it(monkeypatch, columns):
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    for argv in (["plan"], ["--help"]):
        parser = build_parser(argv)
        ours = parser.format_help()
        parser.formatter_class = argparse.HelpFormatter
        assert ours == parser.format_help()


def test_residency_sums_and_changes_as_the_dataclass_operations_do():
    parts = [Residency(1, 2, 3, 4, 5, 6, 7), Residency(anonymous=10, pinned_anonymous=3), Residency()]
    assert sum_residency(parts) == parts[0] + parts[1] + parts[2]
    assert sum_residency([]) == Residency()
    changed = with_residency(parts[0], anonymous=0, file_backed=9)
    assert changed == dataclasses.replace(parts[0], anonymous=0, file_backed=9)


def test_planner_records_are_immutable_and_copy_with_replace():
    sizes = from_declared("dit", "layerwise", 1000, 3, lora_target_bytes=500)
    layer = sizes.layers[0]
    with pytest.raises(AttributeError):
        layer.nbytes = 1
    assert isinstance(layer, Layer) and layer._replace(nbytes=1).nbytes == 1 and layer.nbytes == 334
    assert [u.lora_target_bytes for u in sizes.layers] == [167, 167, 166]
    assert sizes.residency == Residency(not_resident=1000)
