"""bench/device_check.py --dry-run: every part of the GPU check but the CUDA calls, on this host."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from .test_pin_apply import require_mlock

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_device_checks_dry_run_writes_every_part(tmp_path):
    """The shared build is left out here (80 s at its smallest on 2 cores); it is one subprocess
    call of bench/bench_shared_build.py, which has its own quick run."""
    require_mlock(32 << 20)
    out = tmp_path / "out" / "device_check.md"
    done = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "device_check.py"), "--dry-run", "--skip", "shared_build",
         "--size", "32MiB", "--calibrate-size", "8MiB", "--out", str(out), "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    assert text.startswith("## GPU device check (dry run)")
    results = json.loads((tmp_path / "out" / "device_check.json").read_text())
    assert not [p for p, found in results.items() if "error" in found]
    mapping = results["register"]["mapping"]
    assert mapping["succeeded"] and mapping["backend"] == "mlock"
    assert mapping["anonymous_after"] == 0 and mapping["accountant_pinned"] > 0  # pinned in place, no copy
    assert mapping["status_delta"]["VmLck"] == mapping["bytes"]
    executor = results["executor"]
    roles = executor["executor"]["roles"]["dit"]
    assert executor["identical"] and all(roles[k] > 0 for k in ("resident", "pinned", "kept", "released")), roles
    orders = results["orders"]["paths"]
    assert sorted(orders) == ["device twin (cpu)", "host"]
    for path, found in orders.items():  # skips, reverse, repeats, partial passes, CFG, replacements, inference mode
        assert set(found) >= {"skip", "reverse", "repeat", "partial", "cfg", "replace", "inference-mode",
                              "written, then exit"}, found
        assert all(r["identical"] and r["passes"] >= 2 for r in found.values()), (path, found)
    assert "orders on device twin (cpu): identical to the model run whole: skip" in text
    assert results["shared_build"] == {"skipped": "--skip"}
    assert sorted(os.listdir(tmp_path)) == ["out"]  # the checkpoints and probes are gone
