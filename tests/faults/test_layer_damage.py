"""Damaged layer files and manifests: never served, named to the user, rebuilt.

Each fault is made on a complete cache built for real; the next start must serve
exactly the in-place merge and say which file failed and why.
"""

from __future__ import annotations

import json
import os

import pytest

from hostmem.safetensors.mapping import read_header
from hostmem.vault.layer_file import layer_file_name
from planners.cli import main
from tests.faults.world import LAYERS, assert_same, combination_folder, flip_byte, make_world, reference, start

VICTIM = "blocks.2.proj.weight"


def _swap(path: str, other: str) -> None:
    os.rename(path, path + ".x")
    os.rename(other, path)
    os.rename(path + ".x", other)


FAULTS = {
    "truncated": (lambda p, o: os.truncate(p, os.path.getsize(p) - 100), "truncated or corrupt"),
    "appended to": (lambda p, o: open(p, "ab").write(b"\0" * 10), "torn or appended to"),
    "header byte flipped": (lambda p, o: flip_byte(p, 20), "header"),
    "data byte flipped": (lambda p, o: flip_byte(p, read_header(p).data_offset + 1000), "content checksum"),
    "swapped with another layer": (_swap, "holds tensor"),
    "deleted": (lambda p, o: os.unlink(p), "missing"),
    # every start failed on these ([Errno 21] Is a directory as the rebuild took the name)
    "a folder in its place": (lambda p, o: (os.unlink(p), os.mkdir(p)), "not a regular file"),
    "a FIFO in its place": (lambda p, o: (os.unlink(p), os.mkfifo(p)), "not a regular file"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_damaged_layer_file_is_named_and_rebuilt_never_served(tmp_path, capfd, fault):
    world = make_world(tmp_path)
    expected, root = reference(world.base, world.adapter), world.path("root")
    start(world.base, world.adapter, root)
    folder = combination_folder(root)
    damage, said = FAULTS[fault]
    path = os.path.join(folder, layer_file_name(VICTIM))
    damage(path, os.path.join(folder, layer_file_name("blocks.4.proj.weight")))
    capfd.readouterr()
    served, stats = start(world.base, world.adapter, root)
    seen = capfd.readouterr().err
    assert_same(served, expected)
    assert stats.hit + stats.built == LAYERS and 1 <= stats.built <= 2 and stats.fallen_back == 0
    assert "failed its check" in seen and "rebuilding it" in seen and said in seen, seen
    assert VICTIM in seen and layer_file_name(VICTIM) in seen, seen
    served, stats = start(world.base, world.adapter, root)  # and the start after that just hits
    assert_same(served, expected)
    assert (stats.hit, stats.built) == (LAYERS, 0)


@pytest.mark.parametrize("fault", ["manifest not JSON", "manifest naming a missing file"])
def test_a_broken_manifest_is_said_and_the_cache_rebuilt(tmp_path, capfd, fault):
    world = make_world(tmp_path)
    expected, root = reference(world.base, world.adapter), world.path("root")
    start(world.base, world.adapter, root)
    manifest = os.path.join(combination_folder(root), "manifest.json")
    if fault == "manifest not JSON":
        with open(manifest, "w") as handle:
            handle.write("{ not json")
        said, rebuilt = "not JSON", LAYERS
    else:  # a file the cache would not give that layer: the manifest is not trusted, the whole rebuilt
        with open(manifest) as handle:
            data = json.load(handle)
        data["layers"][0]["file"] = "0" * 32 + ".safetensors"
        with open(manifest, "w") as handle:
            json.dump(data, handle)
        said, rebuilt = "is not the name the cache gives it", LAYERS
    capfd.readouterr()
    served, stats = start(world.base, world.adapter, root)
    seen = capfd.readouterr().err
    assert_same(served, expected)
    assert said in seen and manifest.rsplit("/", 1)[0] in seen, seen
    assert stats.built == rebuilt and stats.hit + stats.built == LAYERS


def _cli(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out + err


def test_verify_records_damage_ls_shows_it_prune_removes_it_and_no_start_serves_it(tmp_path, capsys):
    """Damage that keeps the file's times and inode (a bad block): only verify can see it,
    and what it found holds for every start after it."""
    world = make_world(tmp_path)
    expected, root = reference(world.base, world.adapter), world.path("root")
    start(world.base, world.adapter, root)
    path = os.path.join(combination_folder(root), layer_file_name(VICTIM))
    flip_byte(path, read_header(path).data_offset + 8)
    code, out = _cli(capsys, "cache", "verify", "--root", root)
    assert code == 1 and f"{path}: content checksum" in out and "hostmem cache prune" in out
    code, out = _cli(capsys, "cache", "ls", "--root", root)
    assert code == 0 and " damaged " in out and "(recorded in damage.json)" in out
    served, stats = start(world.base, world.adapter, root)  # the record makes the start check again
    assert_same(served, expected)
    assert stats.built == 1 and stats.hit == LAYERS - 1
    code, out = _cli(capsys, "cache", "ls", "--root", root)  # rebuilt: the record is gone
    assert " complete " in out and "damaged" not in out
    flip_byte(path, read_header(path).data_offset + 8)
    assert _cli(capsys, "cache", "verify", "--root", root)[0] == 1
    code, out = _cli(capsys, "cache", "prune", "--root", root)
    assert code == 0 and "damaged" in out and "removed 1 combination(s)" in out
    assert not os.path.exists(os.path.dirname(path))


def test_prune_removes_a_partial_combination_and_dead_writers_temporary_files(tmp_path, capsys):
    world = make_world(tmp_path)
    root = world.path("root")
    start(world.base, world.adapter, root)
    folder = combination_folder(root)
    manifest = os.path.join(folder, "manifest.json")
    with open(manifest) as handle:
        data = json.load(handle)
    data["complete"] = False  # what a build stopped before its last layer seals
    with open(manifest, "w") as handle:
        json.dump(data, handle)
    stray = [os.path.join(folder, ".tmp-999999999-dead.safetensors"), os.path.join(root, "lora_merge_cache", ".tmp-999999999-memo")]
    for path in stray:
        open(path, "wb").close()
    code, out = _cli(capsys, "cache", "ls", "--root", root)
    assert " partial " in out
    code, out = _cli(capsys, "cache", "prune", "--root", root)
    assert code == 0 and "partial" in out and not os.path.exists(folder)
    assert not any(os.path.exists(p) for p in stray)
