"""Names that cannot leave the root: a manifest that names a path, links, FIFOs.

A manifest names each layer's file by the name the vault gives it, nothing else; a
link where the cache keeps a file is never followed; a FIFO or device is never opened
for reading. After each, every weight served equals the in-place merge (or the start is
refused naming the problem) and nothing outside the root changed.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from hostmem.vault import VaultError
from hostmem.vault.admin import prune, verify_all, verify_combination
from hostmem.vault.manifest import MANIFEST_NAME
from tests.conftest import run_python
from tests.faults.world import assert_same, combination_folder, make_world, reference, start
from tests.fresh_fork import TORCH

from .users import snapshot

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _built(tmp_path):
    world = make_world(tmp_path / "world")
    root = str(tmp_path / "root")
    start(world.base, world.adapter, root)
    return world, root, combination_folder(root)


def _edit_first_layer(folder: str, **fields) -> dict:
    path = os.path.join(folder, MANIFEST_NAME)
    with open(path) as handle:
        manifest = json.load(handle)
    manifest["layers"][0].update(fields)
    with open(path, "w") as handle:
        json.dump(manifest, handle)
    return manifest["layers"][0]


@pytest.mark.parametrize("named", ["absolute", "dot-dot", "a link's name"])
def test_a_manifest_naming_a_path_outside_its_folder_touches_nothing_there(tmp_path, named):
    world, root, folder = _built(tmp_path)
    first = json.load(open(os.path.join(folder, MANIFEST_NAME)))["layers"][0]
    victim = str(tmp_path / "victim.safetensors")
    shutil.copyfile(os.path.join(folder, first["file"]), victim)  # a valid layer file, outside the root
    if named == "absolute":
        _edit_first_layer(folder, file=victim)
    elif named == "dot-dot":
        _edit_first_layer(folder, file=os.path.relpath(victim, folder))
    else:
        os.symlink(victim, os.path.join(folder, "elsewhere.safetensors"))
        _edit_first_layer(folder, file="elsewhere.safetensors")
    around = snapshot(tmp_path, [root])
    served, stats = start(world.base, world.adapter, root)
    assert_same(served, reference(world.base, world.adapter))
    assert snapshot(tmp_path, [root]) == around
    (report,) = verify_all(os.path.join(root, "lora_merge_cache"))
    assert report.state == "ok" and snapshot(tmp_path, [root]) == around


def test_a_layer_file_replaced_by_a_link_is_never_followed(tmp_path):
    world, root, folder = _built(tmp_path)
    first = json.load(open(os.path.join(folder, MANIFEST_NAME)))["layers"][0]
    victim = str(tmp_path / "victim.safetensors")
    shutil.move(os.path.join(folder, first["file"]), victim)
    os.symlink(victim, os.path.join(folder, first["file"]))
    around = snapshot(tmp_path, [root])
    with pytest.raises(VaultError, match=rf"{first['file']}: is a symlink; the cache never follows links"):
        start(world.base, world.adapter, root)
    assert snapshot(tmp_path, [root]) == around


def test_verify_writes_nothing_through_a_link_named_like_a_combination(tmp_path):
    world, root, folder = _built(tmp_path)
    elsewhere = str(tmp_path / "elsewhere")
    shutil.copytree(folder, elsewhere)
    cache = os.path.dirname(folder)
    planted = os.path.join(cache, "f" * 64)
    os.symlink(elsewhere, planted)
    around = snapshot(tmp_path, [root])
    reports = {r.key: r for r in verify_all(cache)}
    assert reports["f" * 64].state == "bad" and "symlink" in reports["f" * 64].problems[0]
    assert reports[os.path.basename(folder)].state == "ok"
    assert snapshot(tmp_path, [root]) == around  # no damage.json beside the link's target


def test_verify_and_prune_go_on_past_what_vanished_or_what_they_may_not_touch(tmp_path, capfd):
    world, root, folder = _built(tmp_path)
    cache = os.path.dirname(folder)
    gone = verify_combination(cache, "e" * 64)  # listed, then evicted before its check
    assert gone.state == "gone" and "removed since it was listed" in gone.notes[0]
    os.symlink(str(tmp_path / "world"), os.path.join(cache, "d" * 64 + ".lock"))  # a lock that is a link
    os.lchown(os.path.join(cache, "d" * 64 + ".lock"), 65534, 65534)
    os.mkdir(os.path.join(cache, "d" * 64), 0o700)  # a partial combination: prune removes it...
    os.mkdir(os.path.join(cache, "c" * 64), 0o700)  # ...and this one, after it
    around = snapshot(tmp_path, [root])
    removed = {c.key for c, _ in prune(cache)}
    assert removed == {"c" * 64}
    assert "left " + "d" * 12 in capfd.readouterr().err
    assert os.path.isdir(folder) and snapshot(tmp_path, [root]) == around


_START = """
import json, os, sys
sys.path.insert(0, sys.argv[4])
import torch
from tests.faults.world import reference, start
try:
    served, stats = start(sys.argv[1], sys.argv[2], sys.argv[3])
except ValueError as refused:
    print(json.dumps({"refused": str(refused)}))
else:
    expected = reference(sys.argv[1], sys.argv[2])
    print(json.dumps({"equal": all(torch.equal(served[n], t) for n, t in expected.items()),
                      "built": stats.built, "hit": stats.hit}))
"""


def start_elsewhere(world, root: str, timeout: float = 60) -> tuple[dict, str]:
    """A start in a child process (one that hangs fails the test, not the run): what it
    served (or why it was refused), and what it said."""
    done = run_python(_START, world.base, world.adapter, root, REPO, cwd=REPO, timeout=timeout, forked_from=TORCH)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.parametrize("where", ["content_hashes.json", "verified.json", "damage.json", "manifest.json", "lock",
                                   "a layer file"])
def test_a_fifo_where_the_cache_keeps_a_file_never_hangs_a_start(tmp_path, where):
    world, root, folder = _built(tmp_path)
    cache = os.path.dirname(folder)
    first = json.load(open(os.path.join(folder, MANIFEST_NAME)))["layers"][0]["file"]
    path = {"content_hashes.json": os.path.join(cache, where), "lock": folder + ".lock",
            "a layer file": os.path.join(folder, first)}.get(where, os.path.join(folder, where))
    if os.path.lexists(path):
        os.unlink(path)
    os.mkfifo(path, 0o600)
    around = snapshot(tmp_path, [root])
    outcome, said = start_elsewhere(world, root)
    if where in ("manifest.json", "lock"):  # refused, naming it, or merged in place saying so
        assert "a FIFO" in outcome.get("refused", said), (outcome, said)
    if "refused" not in outcome:
        assert outcome["equal"], outcome
    assert snapshot(tmp_path, [root]) == around
