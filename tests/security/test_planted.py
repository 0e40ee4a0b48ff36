"""Another user plants or moves things into a cache: nothing of theirs is ever served.

Each test runs the other user's steps for real as ``nobody`` (:mod:`.users`), then starts
as this user and checks that every served weight is ``torch.equal`` to the in-place
merge, or that the start is refused with a message naming the problem, and that nothing
outside the cache root was created, written or removed.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from hostmem.vault import VaultError
from hostmem.vault.content_hash import file_digest, hash_name, stamp_of
from hostmem.vault.manifest import MANIFEST_NAME, Manifest
from tests.faults.world import COLS, LAYERS, ROWS, assert_same, combination_folder, make_world, reference, start
from tests.lora_cache.test_adapters import lora_change, write_adapter

from .users import as_nobody, nobody, reachable_by_others, shared_folder, snapshot


def another_adapter(folder) -> str:
    """An adapter on the same layers with other factors: other merged weights."""
    changes = {f"blocks.{i}.proj": lora_change(ROWS, COLS, 4, 100 + i, alpha=2) for i in range(LAYERS)}
    os.makedirs(folder, exist_ok=True)
    return write_adapter(os.path.join(folder, "other.safetensors"), "comfyui", changes)


def _evil_files(world, tmp_path) -> dict[str, bytes]:
    """A combination of the same base with another adapter (other weights, valid checksums):
    its files by name, the manifest last."""
    start(world.base, another_adapter(tmp_path / "other"), str(tmp_path / "evil"))
    folder = combination_folder(str(tmp_path / "evil"))
    names = sorted(os.listdir(folder), key=lambda n: n == MANIFEST_NAME)
    names = [n for n in names if not n.endswith(".json") or n == MANIFEST_NAME]
    return {n: open(os.path.join(folder, n), "rb").read() for n in names}


def _move_in(cache: str, key: str, files: dict[str, bytes]) -> None:
    """As the other user: build the combination in a folder of one's own (its manifest
    keyed, stamped and digested as the vault writes it), then move it in under ``key``."""
    staging = os.path.join(cache, ".mine")
    os.mkdir(staging, 0o755)
    layers = {n: b for n, b in files.items() if n != MANIFEST_NAME}
    for name, data in layers.items():
        with open(os.path.join(staging, name), "wb") as handle:
            handle.write(data)
    manifest = Manifest.from_dict(json.loads(files[MANIFEST_NAME]), "evil")
    manifest.key = key
    manifest.layers = {n: e.with_stamp(stamp_of(os.lstat(os.path.join(staging, e.file))))
                       for n, e in manifest.layers.items()}
    with open(os.path.join(staging, MANIFEST_NAME), "w") as handle:
        json.dump(manifest.to_dict(), handle)
    os.rename(staging, os.path.join(cache, key))


def test_a_combination_another_user_moves_into_a_sticky_cache_is_refused_then_never_served(tmp_path):
    nobody()
    world = make_world(tmp_path / "world")
    expected = reference(world.base, world.adapter)
    key = start(world.base, world.adapter, str(tmp_path / "scratch"))[1].cache_key
    evil = _evil_files(world, tmp_path)
    root = shared_folder(tmp_path)  # the root a user made following the old advice (`chmod +t`)
    cache = os.path.join(root, "lora_merge_cache")
    os.mkdir(cache)
    os.chmod(cache, 0o1777)
    around = snapshot(tmp_path, [root])
    with reachable_by_others(root):
        as_nobody(_move_in, cache, key, evil)
        with pytest.raises(VaultError, match=r"writable by every user.*chmod go-w") as refused:
            start(world.base, world.adapter, root)
        assert "+t" not in str(refused.value)
    os.chmod(root, 0o755)  # what the advice says
    os.chmod(cache, 0o755)
    with pytest.raises(VaultError, match=rf"{key}: owned by uid {nobody()[0]}.*chown"):
        start(world.base, world.adapter, root)  # the fast path for sealed combinations checks it too
    shutil.rmtree(os.path.join(cache, key))
    served, stats = start(world.base, world.adapter, root)
    assert_same(served, expected)
    assert stats.built == len(expected)
    assert snapshot(tmp_path, [root]) == around


def _plant_memo(cache: str, claimed: str, real: str) -> None:
    """As the other user: a content-hash memo saying ``claimed`` holds ``real``'s bytes."""
    stamp = stamp_of(os.stat(claimed))
    memo = {"hash": hash_name(), "files": {f"{stamp[0]}:{stamp[1]}": {"stamp": stamp, "digest": file_digest(real)}}}
    with open(os.path.join(cache, "content_hashes.json"), "w") as handle:
        json.dump(memo, handle)


def test_a_content_hash_memo_another_user_planted_is_not_trusted(tmp_path):
    """The memo claims the second base holds the first's bytes; once the cache folder is
    private again, the file (still the other user's) is not read: each base is served its
    own merge."""
    nobody()
    first, second = make_world(tmp_path / "first"), make_world(tmp_path / "second", seed=2)
    root = os.path.join(tmp_path, "root")
    cache = os.path.join(root, "lora_merge_cache")
    os.makedirs(cache)
    os.chmod(root, 0o711)
    os.chmod(cache, 0o1777)
    with reachable_by_others(tmp_path):
        for path in (first.folder, second.folder):
            os.chmod(path, 0o755)
        as_nobody(_plant_memo, cache, second.base, first.base)
    assert os.stat(os.path.join(cache, "content_hashes.json")).st_uid == nobody()[0]
    os.chmod(cache, 0o700)
    around = snapshot(tmp_path, [root])
    served, _ = start(first.base, first.adapter, root)
    assert_same(served, reference(first.base, first.adapter))
    served, stats = start(second.base, first.adapter, root)
    assert_same(served, reference(second.base, first.adapter))
    assert stats.built == len(served)
    assert snapshot(tmp_path, [root]) == around


def test_a_group_writable_cache_folder_is_refused_with_safe_advice(tmp_path):
    world = make_world(tmp_path / "world")
    root = str(tmp_path / "root")
    start(world.base, world.adapter, root)
    cache = os.path.join(root, "lora_merge_cache")
    os.chmod(cache, 0o770)
    with pytest.raises(VaultError, match=r"lora_merge_cache: a cache folder writable by its group .*chmod go-w"):
        start(world.base, world.adapter, root)


def test_a_combination_renamed_onto_another_key_is_not_served_as_it(tmp_path):
    """Combination A's folder renamed to B's key: B's start finds a manifest of A's key in
    B's folder, serves none of it, and builds B's own weights."""
    world = make_world(tmp_path / "world")
    adapter_b = another_adapter(tmp_path / "other")
    root = str(tmp_path / "root")
    key_b = start(world.base, adapter_b, root)[1].cache_key
    shutil.rmtree(os.path.join(root, "lora_merge_cache", key_b))
    key_a = start(world.base, world.adapter, root)[1].cache_key
    cache = os.path.join(root, "lora_merge_cache")
    os.rename(os.path.join(cache, key_a), os.path.join(cache, key_b))
    served, stats = start(world.base, adapter_b, root)
    assert_same(served, reference(world.base, adapter_b))
    assert stats.built == len(served) and stats.cache_key == key_b


def test_a_root_name_another_user_made_a_link_is_refused(tmp_path):
    """In a sticky shared folder, another user made the per-user root's name first, a link
    to a folder of this user's: the cache is not built where it points."""
    nobody()
    world = make_world(tmp_path / "world")
    shared = shared_folder(tmp_path)
    target = str(tmp_path / "mine")
    os.mkdir(target, 0o700)
    root = os.path.join(shared, "hostmem-root")
    with reachable_by_others(shared):
        as_nobody(os.symlink, target, root)
    around = snapshot(tmp_path, [root])
    with pytest.raises(VaultError, match=rf"hostmem-root: a link made by uid {nobody()[0]}"):
        start(world.base, world.adapter, root)
    assert snapshot(tmp_path, [root]) == around and os.listdir(target) == []


def test_a_manifest_keyed_by_hand_for_another_base_is_not_served(tmp_path):
    """Combination A (one base) moved onto B's key (another base) and its manifest's key
    edited to match its new folder: the base digests it records are not B's, so nothing
    of it is served, on the fast path or the plain one."""
    first, second = make_world(tmp_path / "first"), make_world(tmp_path / "second", seed=2)
    root = str(tmp_path / "root")
    key_b = start(second.base, first.adapter, root)[1].cache_key
    shutil.rmtree(os.path.join(root, "lora_merge_cache", key_b))
    key_a = start(first.base, first.adapter, root)[1].cache_key
    cache = os.path.join(root, "lora_merge_cache")
    os.rename(os.path.join(cache, key_a), os.path.join(cache, key_b))
    path = os.path.join(cache, key_b, MANIFEST_NAME)
    manifest = json.load(open(path))
    manifest["key"] = key_b
    with open(path, "w") as handle:
        json.dump(manifest, handle)
    served, stats = start(second.base, first.adapter, root)
    assert_same(served, reference(second.base, first.adapter))
    assert stats.built == len(served) and stats.cache_key == key_b


def test_a_combination_another_user_planted_under_the_real_key_is_never_adopted_by_a_rekey(tmp_path):
    """A new base is hashed beside its build, which is then named by its real key; the
    real key's folder is already there, complete, planted by another user while the cache
    folder was sticky. The re-key does not take it for this build's: the start serves the
    in-place merge (or refuses, naming the folder's owner)."""
    from hostmem.vault.content_hash import CONTENT_HASH_MEMO

    uid = nobody()[0]
    world = make_world(tmp_path / "world")
    expected = reference(world.base, world.adapter)
    key = start(world.base, world.adapter, str(tmp_path / "scratch"))[1].cache_key
    evil = _evil_files(world, tmp_path)
    root = str(tmp_path / "root")
    cache = os.path.join(root, "lora_merge_cache")
    os.makedirs(cache)
    os.chmod(root, 0o711)
    os.chmod(cache, 0o1777)
    with reachable_by_others(tmp_path):
        as_nobody(_move_in, cache, key, evil)
    os.chmod(cache, 0o700)
    around = snapshot(tmp_path, [root])
    for _ in range(2):  # the folded build, then a start served from what its re-key left
        CONTENT_HASH_MEMO.clear()  # a new process: the first start's build is folded (the base not hashed yet)
        try:
            served, _ = start(world.base, world.adapter, root)
        except VaultError as refused:
            assert f"owned by uid {uid}" in str(refused)
        else:
            assert_same(served, expected)
    assert snapshot(tmp_path, [root]) == around
