"""A part of the cache this user may not open: named, with its fix, and the start goes on.

A key folder, manifest or use file left unreadable (a ``tar`` or ``rsync`` as another user,
a ``chmod`` by hand) raised a bare ``PermissionError`` out of every start, naming the file
by its last name only; one combination's folder so stopped starts of every other. Modes
bind a process without the capability to override them (``setpriv`` drops it here, as an
ordinary user lacks it). Each start still serves the in-place merge's very bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.faults.world import make_world, start

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# In the child, without CAP_DAC_OVERRIDE: each part made unreadable in turn (the owner may
# chmod it), a start, what it served against the in-place merge, and the warnings it gave.
CHILD = r"""
import json, os, sys, warnings
import torch
from tests.faults.world import reference, start
from hostmem.vault.store import Vault
base, adapter, root, other, parts = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
expected = reference(base, adapter)
out = {}
for label, path in parts.items():
    mode = os.stat(path).st_mode & 0o777
    os.chmod(path, 0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            served, stats = start(base, adapter, root)
        out[label] = {"same": all(torch.equal(served[n], t) for n, t in expected.items()), "hit": stats.hit,
                      "said": [str(w.message) for w in caught]}
    except Exception as exc:
        out[label] = {"raised": f"{type(exc).__name__}: {exc}"}
    finally:
        os.chmod(path, mode)
print(json.dumps(out))
"""


def test_an_unreadable_key_folder_manifest_or_use_file_is_named_and_the_start_merges(tmp_path):
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv is not installed")
    world = make_world(tmp_path)
    root = str(tmp_path / "root")
    start(world.base, world.adapter, root)  # the combination a later start hits
    start(world.base, (world.adapter, 0.5), root)  # and another one
    cache = os.path.join(root, "lora_merge_cache")
    keys = sorted(n for n in os.listdir(cache) if len(n) == 64 and os.path.isdir(os.path.join(cache, n)))
    ours = [k for k in keys if json.load(open(os.path.join(cache, k, "manifest.json")))["inputs"]["adapters"][0]
            ["strength"] == 1.0]
    (key,) = ours
    (other,) = [k for k in keys if k != key]
    parts = {"another combination's folder": os.path.join(cache, other), "its key folder": os.path.join(cache, key),
             "its manifest": os.path.join(cache, key, "manifest.json"), "its use file": os.path.join(cache, f"{key}.use")}
    drop = "-dac_override,-dac_read_search"
    done = subprocess.run([setpriv, f"--inh-caps={drop}", f"--bounding-set={drop}", sys.executable, "-c", CHILD,
                           world.base, world.adapter, root, other, json.dumps(parts)],
                          capture_output=True, text=True, timeout=240, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["another combination's folder"] == {"same": True, "hit": 6, "said": []}
    for label in ("its key folder", "its manifest", "its use file"):
        case = found[label]
        assert "raised" not in case, (label, case)
        assert case["same"] and case["hit"] == 0, (label, case)
        (said,) = [s for s in case["said"] if "Permission denied" in s]
        assert f"Permission denied: {parts[label]} " in said and "chmod u+rw" in said and "in place" in said, said


def test_the_cache_commands_name_a_root_this_user_may_not_look_into(tmp_path):
    """It was listed as empty ("no cached LoRA merges"), exit 0, while a start refused it."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv is not installed")
    world = make_world(tmp_path)
    root = tmp_path / "root"
    start(world.base, world.adapter, str(root))
    drop = "-dac_override,-dac_read_search"
    os.chmod(root, 0)
    try:
        for command in ("ls", "verify", "prune"):
            done = subprocess.run([setpriv, f"--inh-caps={drop}", f"--bounding-set={drop}", sys.executable, "-m",
                                   "planners.cli", "cache", command, "--root", str(root)],
                                  capture_output=True, text=True, timeout=120, cwd=REPO)
            assert done.returncode == 2, (command, done.stdout, done.stderr)
            assert f"{root}: cannot be opened as a cache root (Permission denied)" in done.stderr, done.stderr
            assert "no cached" not in done.stdout and "Traceback" not in done.stderr
    finally:
        os.chmod(root, 0o700)


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_use_file_that_is_a_fifo_or_a_folder_is_named_and_the_start_merges_in_place(tmp_path, kind):
    """The same thing as the key's lock file got one warning and an in-place merge; as its
    use file it failed the whole start."""
    import warnings

    from tests.faults.world import assert_same, reference

    world = make_world(tmp_path)
    root = str(tmp_path / "root")
    start(world.base, world.adapter, root)
    cache = os.path.join(root, "lora_merge_cache")
    (key,) = [n for n in os.listdir(cache) if len(n) == 64 and os.path.isdir(os.path.join(cache, n))]
    use = os.path.join(cache, f"{key}.use")
    os.unlink(use)
    os.mkfifo(use) if kind == "fifo" else os.mkdir(use)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        served, stats = start(world.base, world.adapter, root)
    assert_same(served, reference(world.base, world.adapter))
    assert stats.hit == 0
    (said,) = [str(w.message) for w in caught if use in str(w.message)]
    assert "in place" in said and f"is a {kind.upper() if kind == 'fifo' else kind}," in said, said
