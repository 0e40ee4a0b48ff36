"""SIGKILL of a real build at every write, fsync and rename it makes, then a start.

Each kill point is a phase of the build: a layer's data or header, its fsync or rename,
the content-hash memo, the kernel timings, the verification memo, the manifest, a
folder fsync. After each, a start must serve exactly the in-place merge, resume from
the layers that were sealed, and leave no temporary file behind. A build sealed behind
its start (its layers written through the page cache, fsynced and named by the seal's
thread) is killed at every one of its points too.
"""

from __future__ import annotations

import shutil

import pytest

from tests.faults.world import LAYERS, assert_same, build_in_child, leftovers, make_world, reference, start


@pytest.mark.parametrize("behind", ["", "hashed"], ids=["sealed in the start", "sealed behind the start"])
def test_a_build_killed_at_every_write_fsync_and_rename_resumes_to_the_in_place_bytes(tmp_path, capfd, behind):
    world = make_world(tmp_path)
    expected = reference(world.base, world.adapter)
    clean = build_in_child(world, world.path("clean-root"), behind=behind)
    assert clean.returncode == 0, clean.stderr
    assert f"behind {bool(behind)}" in clean.stdout
    total = int(clean.stdout.split("calls ")[1])
    assert total >= 30, f"only {total} kill points"
    killed = build_in_child(world, world.path("root"), kill_at=range(1, total + 1), behind=behind)
    outcomes = dict(line.split(" ", 1) for line in killed.stdout.splitlines())
    assert outcomes == {str(n): "killed" for n in range(1, total + 1)}, killed.stderr[-2000:]
    resumed_somewhere = False
    for kill_at in range(1, total + 1):
        root = world.path(f"root-{kill_at}")
        capfd.readouterr()
        served, stats = start(world.base, world.adapter, root)
        seen = capfd.readouterr().err
        assert_same(served, expected)
        assert (stats.hit + stats.built, stats.fallen_back, stats.in_place) == (LAYERS, 0, 0), (kill_at, seen)
        assert "Traceback" not in seen and not leftovers(root), (kill_at, seen, leftovers(root))
        resumed_somewhere |= stats.hit > 0
        shutil.rmtree(root)
    assert resumed_somewhere, "no kill point left a sealed layer to resume from"
