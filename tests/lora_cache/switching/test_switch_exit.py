"""A process that exits while a background build runs: no warning, nothing torn, the next start serves it.

An exit is not a failure. concurrent.futures refuses new work once the interpreter
begins to exit, which cuts a background build short; that must not read as
"building the merged combination failed".
"""

from __future__ import annotations

import os

from tests.conftest import run_python

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# Switches to an adapter (applied at run time, built in the background) and exits at once.
_EXIT_DURING_BUILD = r"""
import os, sys
import torch, lora_cache
from tests.lora_cache.switching.test_runtime_lora import stack_adapter, stack_model
folder = sys.argv[1]
model = stack_model(folder, 256, 16, torch.bfloat16)
adapter = stack_adapter(os.path.join(folder, "a.safetensors"), 256, 16, 1, rank=8, dtype=torch.bfloat16)
print(lora_cache.set_adapters(model, [adapter], cache_root=os.path.join(folder, "root")).mode, flush=True)
"""


def test_an_exit_during_a_background_build_is_no_failure(tmp_path):
    done = run_python(_EXIT_DURING_BUILD, str(tmp_path), cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["runtime"]
    assert "failed" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    leftovers = [n for _, _, names in os.walk(tmp_path / "root") for n in names if n.startswith(".tmp-")]
    assert leftovers == []
