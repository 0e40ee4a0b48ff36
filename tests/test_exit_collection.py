"""The commands that write exit as a user's process does: cleanly, leaving nothing behind.

The suite's processes skip the interpreter's last collection at exit (``tests/exit_site``);
these start theirs without it (``env_with_exit_collection``), so a finalizer of an object
in a cycle runs at exit here as it does for a user: a build's ``hostmem lora merge``, a
server's start that merges through the cache, and ``hostmem guard`` (its peak tracker)
each exit 0, say nothing of an exception at exit, and leave nothing in their temp folder.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("diffusers", reason="the tiny model is a diffusers model (pip install hostmem[test])")
pytest.importorskip("peft", reason="the adapter is written by peft (pip install hostmem[test])")

from tests.clients import tiny_models as tm  # noqa: E402
from tests.conftest import env_with_exit_collection, write_lora_config  # noqa: E402

START = """
import sys
import torch
import lora_cache
from tests.clients import tiny_models as tm

model = tm.load_model("flux", sys.argv[1], torch.bfloat16)
stats = lora_cache.load_lora(tm.pipeline("flux", model), sys.argv[2], 0.8, cache_root=sys.argv[3], progress=False)
print(stats.hit, stats.built)
"""


def _run(tmp_path, *cmd: str) -> subprocess.CompletedProcess:
    temp = tmp_path / "temp"
    temp.mkdir(exist_ok=True)
    env = {**env_with_exit_collection(), "TMPDIR": os.fspath(temp)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env["PYTHONPATH"]]))
    done = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=300, env=env)
    assert "exit_site" not in env["PYTHONPATH"]
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert os.listdir(temp) == [], f"left in its temp folder: {os.listdir(temp)}"
    return done


def test_a_build_a_server_start_and_the_guard_exit_cleanly_with_the_last_collection(tmp_path):
    model = tm.save_model("flux", tmp_path / "model", torch.bfloat16)
    adapter = os.path.join(tm.write_adapters("flux", model, tmp_path / "adapters")["diffusers_meta"],
                           "pytorch_lora_weights.safetensors")
    config = write_lora_config(tmp_path, model, adapter, strength=0.8, layers="transformer_blocks.{i}.")
    _run(tmp_path, "-m", "planners.cli", "lora", "merge", config, "--json")
    served = _run(tmp_path, "-c", START, model, adapter, os.fspath(tmp_path / "cache"))
    hit, built = map(int, served.stdout.split()[-2:])
    assert hit > 0 and built == 0
    _run(tmp_path, "-m", "planners.cli", "guard", "--max-peak-anon", "1GiB", "--", sys.executable, "-c", "pass")
