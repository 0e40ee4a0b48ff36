"""Light commands stay light: none of them imports torch (bench/bench_cli.py times them).

Each command runs in a fresh interpreter through the real entry point; afterwards the
interpreter reports whether ``torch`` is in ``sys.modules``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.planners.conftest import write_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1024 * 1024

PROBE = r"""
import sys
from planners.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:  # --version, --help
    code = exc.code
print(f"\nexit={code} torch={'torch' in sys.modules} psutil={'psutil' in sys.modules}", file=sys.stderr)
"""


def imported(*argv, cwd=REPO) -> set[str]:
    """Which of torch and psutil the command imported."""
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, cwd=cwd, timeout=120)
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("exit=") and not last.startswith("exit=1 "), out.stderr
    return {name for name in ("torch", "psutil") if f" {name}=True" in last}


def torch_imported(*argv, cwd=REPO) -> bool:
    return "torch" in imported(*argv, cwd=cwd)


def test_inspect_guard_version_and_declared_plans_do_not_import_torch():
    assert not torch_imported("inspect", "--top", "1")
    assert not torch_imported("inspect", "--pid", str(os.getpid()), "--json")
    assert not torch_imported("--version")
    assert not torch_imported("guard", "--max-peak-anon", "1GiB", "--", sys.executable, "-c", "pass")
    for name in ("minimax-h3-32g.yaml", "workstation-24g.yaml", "demo.yaml"):
        assert not torch_imported("plan", os.path.join("configs", name), "--json")


def test_a_plan_from_checkpoint_headers_does_not_import_torch(tmp_path):
    write_checkpoint(tmp_path / "dit", layers=4, layer_bytes=MiB, files=2)
    write_checkpoint(tmp_path / "te", layers=2, layer_bytes=MiB, prefix="encoder.block")
    config = tmp_path / "deploy.yaml"
    config.write_text(
        "deployment: t\nhost: {limit: 1GiB, reserve: 64MiB}\nworkload: {steps: 4}\ncomponents:\n"
        '  dit: {path: dit, layers: "blocks.{i}.", offload: layerwise, lora_targets: ["blocks.*.w0"]}\n'
        '  te: {path: te, layers: "encoder.block.{i}.", offload: full}\n'
    )
    assert not torch_imported("plan", str(config), "--what-if", "in-place")


def test_the_guard_reads_the_process_tree_from_proc_not_psutil():
    """Counting and ending the command's tree takes /proc alone: psutil costs the guard
    more start-up than everything else it imports."""
    assert imported("guard", "--no-children", "--max-peak-anon", "1GiB", "--", sys.executable, "-c", "pass") == set()
    assert imported("guard", "--max-peak-anon", "1GiB", "--", "sh", "-c", "sleep 0.1 & wait") == set()


def cached_combination(root) -> str:
    """A real sealed combination of two layers under ``root``; its key."""
    import torch

    from hostmem.vault import Vault

    key = "ab" * 32
    layers = {f"blocks.{i}.w": torch.randn(16, 16) for i in range(2)}
    with Vault(root).open(key, {n: (tuple(t.shape), t.dtype) for n, t in layers.items()}) as session:
        for name, tensor in layers.items():
            session.put(name, tensor)
    return key


@pytest.mark.parametrize("action", [("ls",), ("verify",), ("prune", "--dry-run"), ("rm", "abab")])
def test_cache_commands_do_not_import_torch(tmp_path, action):
    """On a root holding a combination, so that verify reads every layer's header and checksum."""
    cached_combination(tmp_path)
    assert not torch_imported("cache", *action, "--root", str(tmp_path))
    assert os.listdir(tmp_path / "lora_merge_cache") == ([] if action[0] == "rm" else ["abab" * 16])
