"""A new base is hashed beside its build (a folded build), and re-keyed when the digests are known.

Every start here is real: mapped checkpoints, real cache roots, real child processes
killed with SIGKILL. After each: every merged weight ``torch.equal`` to the in-place
merge, and nothing provisional ever served.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

import lora_cache
from hostmem.vault.combinations import list_combinations
from hostmem.vault.content_hash import CONTENT_HASH_MEMO, load_memo_file, stamp_of
from hostmem.vault import fold
from hostmem.vault.fold import BuildCursor, FoldedSession
from hostmem.vault.manifest import read_manifest
from hostmem.vault.provisional import MARKER_NAME
from lora_cache.placement.layers import checkpoint_module
from lora_cache.orchestrate import merge_layers, open_combination, plan_targets
from tests.faults.world import (LAYERS, assert_same, build_in_child, combination_folder, flip_byte_keeping_times,
                                leftovers, make_world, reference, start)


def fresh_start(base: str, adapter: str, roots):
    """A start as a new process makes it: no digest known in this process."""
    CONTENT_HASH_MEMO.clear()
    return start(base, adapter, roots)


def open_folded(world, root: str):
    """``(model, planned targets, session)``: a fresh start's folded session, opened, nothing built."""
    CONTENT_HASH_MEMO.clear()
    model = checkpoint_module([world.base])
    spec = [lora_cache.Adapter(world.adapter)]
    planned = plan_targets(model, spec)
    session = open_combination(planned, spec, root).session
    assert isinstance(session, FoldedSession)
    return model, planned, session


def markers(root: str) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names if n == MARKER_NAME]


def test_a_folded_build_is_the_in_place_merge_and_memoises_the_base(tmp_path):
    world = make_world(tmp_path)
    expected, root = reference(world.base, world.adapter), world.path("root")
    served, stats = fresh_start(world.base, world.adapter, root)
    assert_same(served, expected)
    assert (stats.built, stats.hit) == (LAYERS, 0)
    folder = combination_folder(root)
    manifest = read_manifest(folder)
    assert os.path.basename(folder) == stats.cache_key == manifest.key and manifest.complete
    assert "provisional" not in manifest.inputs and not markers(root) and not leftovers(root)
    memo = load_memo_file(os.path.join(root, "lora_merge_cache", "content_hashes.json"))
    (digest,) = [d for s, d in memo.values() if s == stamp_of(os.stat(world.base))]
    assert [s["digest"] for s in manifest.inputs["base"]["shards"]] == [digest]

    computed = CONTENT_HASH_MEMO.computed
    served, stats = fresh_start(world.base, world.adapter, root)
    assert_same(served, expected)
    assert (stats.hit, stats.built, stats.cache_key) == (LAYERS, 0, os.path.basename(folder))
    assert CONTENT_HASH_MEMO.computed == computed, "the second start hashed the base again"


def test_the_folded_build_runs_under_a_marked_provisional_key_and_reads_in_file_order(tmp_path):
    world = make_world(tmp_path)
    root = world.path("root")
    hashed_first, _ = fresh_start(world.base, world.adapter, world.path("hashed-first"))  # the real key's bytes
    CONTENT_HASH_MEMO.clear()
    model = checkpoint_module([world.base])
    spec = [lora_cache.Adapter(world.adapter)]
    planned = plan_targets(model, spec)
    opened = open_combination(planned, spec, root)
    session = opened.session
    assert isinstance(session, FoldedSession)
    provisional = session.key
    with open(os.path.join(session.folder, MARKER_NAME)) as handle:
        assert json.load(handle)["provisional_key"] == provisional
    ordered = [t.name for t in session.in_file_order(list(reversed(planned[0])))]
    assert ordered == [n for n in _by_offset(world.base) if n in ordered] and len(ordered) == LAYERS
    with session:
        merge_layers(planned[0], session, progress=False, fallback=False)
    assert session.key != provisional and session.key == os.path.basename(combination_folder(root))
    assert not os.path.exists(os.path.join(root, "lora_merge_cache", provisional))
    assert not markers(root)
    assert_same({n: p.detach().clone() for n, p in model.named_parameters()}, hashed_first)
    lora_cache.unmerge(model)


def _by_offset(path: str) -> list[str]:
    """Tensor names in the order of their data in the file."""
    with open(path, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(size))
    header.pop("__metadata__", None)
    return sorted(header, key=lambda n: header[n]["data_offsets"][0])


def test_a_copied_base_with_a_cache_baked_read_only_hashes_first_and_builds_nothing(
        tmp_path, read_only_copy):  # noqa: F811  (the fixture)
    world = make_world(tmp_path)
    expected = reference(world.base, world.adapter)
    fresh_start(world.base, world.adapter, world.path("image-root"))
    baked = read_only_copy(world.path("image-root"))
    os.mkdir(world.path("host"))
    copied = shutil.copy(world.base, world.path("host", "base.safetensors"))  # new inode, new times
    local = world.path("local")
    served, stats = fresh_start(copied, world.adapter, [baked, local])
    assert_same(served, expected)
    assert (stats.hit, stats.built) == (LAYERS, 0)
    assert stats.cache_root == baked
    cache = os.path.join(local, "lora_merge_cache")
    assert [n for n in os.listdir(cache) if len(n.split(".")[0]) == 64] == [], "a build started in the local root"


def test_a_base_changed_in_one_byte_with_its_times_restored_gets_a_new_key(tmp_path):
    world = make_world(tmp_path)
    _, before = fresh_start(world.base, world.adapter, world.path("root-a"))
    flip_byte_keeping_times(world.base, os.path.getsize(world.base) - 3)
    expected = reference(world.base, world.adapter)
    served, folded = fresh_start(world.base, world.adapter, world.path("root-b"))  # a fresh root: it folds
    assert_same(served, expected)
    assert folded.built == LAYERS and folded.cache_key != before.cache_key
    served, hashed = fresh_start(world.base, world.adapter, world.path("root-a"))  # a look-alike there: hash first
    assert_same(served, expected)
    assert (hashed.built, hashed.cache_key) == (LAYERS, folded.cache_key)


def _state(root: str, real: str) -> str:
    """What a killed build left: nothing, a provisional folder, the real key still
    marked provisional, or the real combination."""
    cache = os.path.join(root, "lora_merge_cache")
    names = [n for n in os.listdir(cache) if len(n) == 64] if os.path.isdir(cache) else []
    if not names:
        return "nothing"
    (name,) = names
    marked = os.path.exists(os.path.join(cache, name, MARKER_NAME))
    if name != real:
        return "provisional" if marked else "unmarked provisional"
    return "real, still marked" if marked else "real"


@pytest.mark.parametrize("behind", ["", "folded"], ids=["sealed in the start", "sealed behind the start"])
def test_sigkill_anywhere_in_a_folded_build_never_serves_a_provisional_folder(tmp_path, capfd, behind):
    """Also where the seal and the re-key run on the seal's thread, after the start."""
    world = make_world(tmp_path)
    expected = reference(world.base, world.adapter)
    clean = build_in_child(world, world.path("clean"), behind=behind)
    assert clean.returncode == 0, clean.stderr
    assert f"behind {bool(behind)}" in clean.stdout
    real, total = os.path.basename(combination_folder(world.path("clean"))), int(clean.stdout.split("calls ")[1])
    thread_from = int(clean.stdout.split("seal thread from ")[1].split()[0]) or total + 1
    assert not behind or thread_from <= total, "nothing was sealed on the seal's thread"
    # behind, every point on the seal's thread and every third before it (the start's points are the other test's)
    points = [n for n in range(1, total + 1) if not behind or n >= thread_from or n % 3 == 0]
    killed = build_in_child(world, world.path("root"), kill_at=points, behind=behind)
    assert all(line.endswith("killed") for line in killed.stdout.splitlines()), killed.stderr[-2000:]
    seen_states = set()
    for kill_at in points:
        root = world.path(f"root-{kill_at}")
        state = _state(root, real)
        seen_states.add(state)
        if state == "unmarked provisional":  # killed after the folder was made, before it was marked
            cache = os.path.join(root, "lora_merge_cache")
            (folder,) = [os.path.join(cache, n) for n in os.listdir(cache) if len(n) == 64]
            assert not [n for n in os.listdir(folder) if n.endswith(".safetensors")], (kill_at, os.listdir(folder))
        if state in ("provisional", "real, still marked"):
            listed = list_combinations(os.path.join(root, "lora_merge_cache"))
            assert [c.state for c in listed] == ["provisional"], (kill_at, listed)
        served, stats = fresh_start(world.base, world.adapter, root)
        assert_same(served, expected)
        assert stats.cache_key == real and stats.hit + stats.built == LAYERS, (kill_at, state)
        if state != "real":
            assert stats.built == LAYERS, f"kill point {kill_at} ({state}): a provisional layer was served"
        assert not markers(root) and not leftovers(root), kill_at
        shutil.rmtree(root)
    capfd.readouterr()
    assert {"provisional", "real, still marked", "real"} <= seen_states, seen_states


def test_hostmem_cache_ls_and_prune_show_and_remove_a_provisional_folder(tmp_path):
    world = make_world(tmp_path)
    clean = build_in_child(world, world.path("clean"))
    real, total = os.path.basename(combination_folder(world.path("clean"))), int(clean.stdout.split("calls ")[1])
    last = range(max(1, total - 9), total + 1)  # the re-key's renames and fsyncs come last
    killed = build_in_child(world, world.path("root"), kill_at=last)  # one child: a fork a point
    assert killed.returncode == 0, killed.stderr[-2000:]
    at = next(n for n in reversed(last) if _state(world.path(f"root-{n}"), real) == "real, still marked")
    root = world.path(f"root-{at}")
    cli = [sys.executable, "-m", "planners.cli", "cache"]
    shown = subprocess.run([*cli, "ls", "--root", root], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "provisional" in shown.stdout, shown.stdout + shown.stderr
    pruned = subprocess.run([*cli, "prune", "--root", root], capture_output=True, text=True, timeout=60)
    assert pruned.returncode == 0, pruned.stderr
    assert _state(root, real) == "nothing"


@pytest.mark.parametrize("hashed", [True, False], ids=["hash done: re-keyed", "hash unfinished: kept"])
def test_an_interrupted_folded_build_keeps_its_layers_for_the_next_start_to_resume(tmp_path, monkeypatch, hashed):
    world = make_world(tmp_path)
    expected, root = reference(world.base, world.adapter), world.path("root")
    monkeypatch.setattr(fold, "FOLD_WINDOW", None if hashed else 0)  # 0: the hasher never passes the build
    model, planned, session = open_folded(world, root)
    with pytest.raises(KeyboardInterrupt), session:
        merge_layers(session.in_file_order(planned[0])[:2], session, progress=False, fallback=False)
        while hashed and CONTENT_HASH_MEMO.known(world.base)[1] is None:
            time.sleep(0.01)
        raise KeyboardInterrupt
    lora_cache.unmerge(model, strict=False)
    assert len(session.layers) == 2
    (left,) = list_combinations(os.path.join(root, "lora_merge_cache"))
    assert left.state == ("partial" if hashed else "provisional")
    served, stats = fresh_start(world.base, world.adapter, root)
    assert_same(served, expected)
    assert (stats.hit, stats.built) == (2, LAYERS - 2)
    assert not markers(root) and stats.cache_key == os.path.basename(combination_folder(root))


def test_an_interrupt_while_the_seal_waits_for_the_hash_keeps_every_layer_and_the_next_start_resumes(
        tmp_path, monkeypatch):
    """Ctrl-C (or a SIGTERM turned into one) while the seal waits for the hasher to finish
    the base: every layer stays, marked resumable, and the next start takes them up, also
    when the hasher finished meanwhile and the base's digest is now known."""
    world = make_world(tmp_path)
    expected, root = reference(world.base, world.adapter), world.path("root")
    finish = fold.BaseHasher.result

    def interrupted(self):
        finish(self)  # the digest is memoised: the next start knows the key at once
        raise KeyboardInterrupt

    monkeypatch.setattr(fold.BaseHasher, "result", interrupted)
    _interrupted_build(world, root)
    monkeypatch.undo()
    assert CONTENT_HASH_MEMO.known(world.base)[1] is not None
    _every_layer_hits(world, root, expected)


def _interrupted_build(world, root: str):
    """A folded build of every layer that a KeyboardInterrupt stops; its session."""
    model, planned, session = open_folded(world, root)
    with pytest.raises(KeyboardInterrupt), session:
        merge_layers(session.in_file_order(planned[0]), session, progress=False, fallback=False)
    lora_cache.unmerge(model, strict=False)
    return session


def _every_layer_hits(world, root: str, expected) -> None:
    """The next start serves the in-place bytes from the real key's folder, building nothing."""
    served, stats = fresh_start(world.base, world.adapter, root)
    assert_same(served, expected)
    assert (stats.hit, stats.built) == (LAYERS, 0)
    assert not markers(root) and stats.cache_key == os.path.basename(combination_folder(root))


def test_the_hasher_waits_for_the_build_within_its_window():
    cursor, reached = BuildCursor(window=100), []
    waiter = threading.Thread(target=lambda: (cursor.wait(500), reached.append(True)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not reached, "the hasher ran more than its window ahead of the build"
    cursor.advance(450)
    waiter.join(5)
    assert reached == [True]


def test_a_base_that_changes_while_it_is_hashed_fails_the_start_and_leaves_nothing_built(tmp_path, monkeypatch):
    world = make_world(tmp_path)
    expected, root = reference(world.base, world.adapter), world.path("root")
    monkeypatch.setattr(fold, "FOLD_WINDOW", 0)  # the hasher never passes the build: it cannot finish first
    model, planned, session = open_folded(world, root)
    stat = os.stat(world.base)
    os.utime(world.base, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # rewritten, as far as stamps go
    # the build's own check sees it at the first layer (lora_cache.key.base_stamps), before the hasher's
    with pytest.raises(ValueError, match="changed since this merge keyed it"), session:
        merge_layers(session.in_file_order(planned[0]), session, progress=False, fallback=False)
    lora_cache.unmerge(model, strict=False)
    cache = os.path.join(root, "lora_merge_cache")
    folders = [n for n in os.listdir(cache) if len(n) == 64 and os.path.isdir(os.path.join(cache, n))]
    assert folders == [], "what was built from it stayed"
    assert not markers(root) and not leftovers(root)
    served, stats = fresh_start(world.base, world.adapter, root)
    assert_same(served, expected)
    assert stats.built == LAYERS


_MERGE_IN_CHILD = """
import json, sys
import lora_cache
from lora_cache.placement.layers import checkpoint_module
model = checkpoint_module([sys.argv[1]])
stats = lora_cache.merge(model, [sys.argv[2]], cache_root=sys.argv[3], progress=False)
print(json.dumps({"built": stats.built, "hit": stats.hit, "key": stats.cache_key}))
"""


def test_a_start_waiting_on_a_folded_build_of_its_base_maps_what_it_built_instead_of_building_again(
        tmp_path, monkeypatch):
    """Two starts on a new base at once fold under the same provisional key: the second waits
    for the first's lock, and once the first has re-keyed, it finds the base's digests in
    the memo and opens the real key (a hit) instead of building every layer a second time."""
    world = make_world(tmp_path)
    expected, root = reference(world.base, world.adapter), world.path("root")
    monkeypatch.setattr(fold, "FOLD_WINDOW", 0)  # the hash keeps behind the build: not done before it is
    model, planned, session = open_folded(world, root)
    _another_start_maps_the_build(world, root, model, planned, session, expected, "is in use by another process")


def test_a_start_that_finds_the_base_hashed_waits_for_the_folded_build_still_under_way(tmp_path, monkeypatch):
    """The first start's hash is done (the memo has the digest) but its build is not: a start
    then knows the real key, which is not built yet; it waits for the provisional build
    instead of building every layer beside it, and maps what that one re-keyed."""
    world = make_world(tmp_path)
    expected, root = reference(world.base, world.adapter), world.path("root")
    monkeypatch.setattr(fold, "FOLD_WINDOW", None)  # the hash runs ahead, free
    model, planned, session = open_folded(world, root)
    memo_file = os.path.join(root, "lora_merge_cache", "content_hashes.json")
    deadline = time.monotonic() + 60
    while CONTENT_HASH_MEMO.known(world.base, memo_file)[1] is None and time.monotonic() < deadline:
        time.sleep(0.01)
    _another_start_maps_the_build(world, root, model, planned, session, expected,
                                  "another start is building this combination")


def _another_start_maps_the_build(world, root, model, planned, session, expected, waits_with: str) -> None:
    """Start a merge in a child process, see it wait (its first line says ``waits_with``),
    build every layer in ``session`` meanwhile, and check the child built nothing: it
    mapped the re-keyed combination, the only one left."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    other = subprocess.Popen([sys.executable, "-c", _MERGE_IN_CHILD, world.base, world.adapter, root], cwd=repo,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        waiting = other.stderr.readline()
        assert waits_with in waiting, waiting + other.stderr.read()
        with session:
            merge_layers(session.in_file_order(planned[0]), session, progress=False, fallback=False)
        out, err = other.communicate(timeout=120)
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()
    assert other.returncode == 0, err
    found = json.loads(out.strip().splitlines()[-1])
    assert (found["built"], found["hit"], found["key"]) == (0, LAYERS, session.key), found
    assert_same(dict(model.named_parameters()), expected)
    assert [c.key for c in list_combinations(os.path.join(root, "lora_merge_cache"))] == [session.key]
    assert not markers(root) and not leftovers(root)


@pytest.mark.parametrize("step", ["write_manifest", "rename_in", "unmark_provisional"])
def test_ctrl_c_in_the_re_key_of_a_finished_build_comes_after_it_and_the_next_start_hits_every_layer(
        tmp_path, monkeypatch, step):
    """A real SIGINT sent while a finished folded build is being named by its real key (the
    manifest rewritten, the folder renamed, the marker removed): the re-key ends first,
    the interrupt comes after it, and the next start maps every layer. Cut half-way, the
    folder was left provisional (swept, built again) or removed as unreadable."""
    import signal

    from hostmem.vault import rekey

    world = make_world(tmp_path)
    expected, root = reference(world.base, world.adapter), world.path("root")
    real_step = getattr(rekey, step)

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # Python runs its handler at the next bytecode: inside the re-key
        for _ in range(1000):
            pass
        return real_step(*args, **kwargs)

    monkeypatch.setattr(rekey, step, interrupted)
    model, planned, session = open_folded(world, root)
    with pytest.raises(KeyboardInterrupt), session:
        merge_layers(session.in_file_order(planned[0]), session, progress=False, fallback=False)
    monkeypatch.setattr(rekey, step, real_step)
    lora_cache.unmerge(model, strict=False)
    served, stats = fresh_start(world.base, world.adapter, root)
    assert_same(served, expected)
    assert (stats.hit, stats.built) == (LAYERS, 0)
    assert not markers(root) and stats.cache_key == os.path.basename(combination_folder(root))


def test_an_interrupt_as_the_seal_names_the_build_by_its_real_key_keeps_every_layer_for_the_next_start(
        tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM) after the hash is done and before the re-key takes the real key's
    lock: the whole build is named by its real key all the same, and the next start hits every
    layer (it was left provisional with its base known, which the next start swept and built again)."""
    world = make_world(tmp_path)
    expected, root = reference(world.base, world.adapter), world.path("root")
    real_key, calls = fold.Fold.real_key, []

    def interrupted(self, digests):
        calls.append(digests)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real_key(self, digests)

    monkeypatch.setattr(fold.Fold, "real_key", interrupted)
    _interrupted_build(world, root)
    monkeypatch.undo()
    _every_layer_hits(world, root, expected)
    assert len(calls) == 2


def test_a_signal_held_over_the_re_key_counts_every_layer_it_named(tmp_path, monkeypatch):
    """A signal that came while the build was being named by its real key is raised as that
    ends: the interrupted line counts the layers now under the real key (it said none)."""
    from hostmem.vault import rekey as rekey_module

    world = make_world(tmp_path)
    root = world.path("root")
    held = rekey_module._rekey_held

    def signalled(*args):
        held(*args)
        raise KeyboardInterrupt  # as interrupts_deferred hands over a signal that came meanwhile

    monkeypatch.setattr(rekey_module, "_rekey_held", signalled)
    session = _interrupted_build(world, root)
    assert len(session.layers) == LAYERS
    assert session.key == os.path.basename(combination_folder(root))
