"""The vault as a store: layout, round trips, adoption, dropping, safety of the root."""

from __future__ import annotations

import json
import os
import signal
import stat

import pytest
import torch
from safetensors import safe_open

from hostmem.procfs import filesystem_of
from hostmem.safetensors.mapping import read_header, tensor_bytes
from hostmem.crc32 import crc32_of
from hostmem.vault import Vault, VaultError, cache_key
from hostmem.vault.admin import verify_combination
from hostmem.vault.layer_file import data_crc32, layer_file_name
from tests.conftest import run_python, transparent_huge_pages, vma_holding

SHAPE = (64, 48)

# A child start's first lines: the vault at argv[1] holds argv[2] layers of the key tagged
# argv[3], built by the first start; ``built`` says whether this start built them.
CHILD_START = r"""
import json, os, sys
import torch
from hostmem.vault import Vault, cache_key

root, count, tag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
key = cache_key({"shards": ["base"]}, [], "bfloat16", tag)
vault = Vault(root)
tensors = {f"blocks.{i}.w": torch.full((64, 48), float(i)) for i in range(count)}
expected = {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}
built = not os.path.isdir(os.path.join(vault.cache, key.hex))
if built:
    with vault.open(key, expected) as session:
        for name, tensor in tensors.items():
            session.put(name, tensor)
"""


def key_for(tag: str):
    return cache_key({"shards": [{"path": f"/models/{tag}.safetensors"}]}, [], "bfloat16", "test")


def layers(dtype=torch.bfloat16, count=3, seed=0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"blocks.{i}.attn.qkv.weight": torch.randn(SHAPE, generator=gen).to(dtype) for i in range(count)}


def expected_of(tensors: dict[str, torch.Tensor]) -> dict:
    return {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}


def build(vault: Vault, key, tensors: dict[str, torch.Tensor]) -> dict:
    with vault.open(key, expected_of(tensors)) as session:
        for name, tensor in tensors.items():
            assert session.put(name, tensor) is not None, session.last_error
        assert session.complete
        return dict(session.stats)


def folder_of(vault: Vault, key) -> str:
    return os.path.join(vault.cache, key.hex)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_put_then_get_in_a_later_session_is_bit_identical_and_mapped_read_only(tmp_path, dtype):
    vault, key, tensors = Vault(tmp_path / "root"), key_for("rt"), layers(dtype)
    stats = build(vault, key, tensors)
    assert stats["layers_written"] == 3 and stats["bytes_written"] > 3 * tensors["blocks.0.attn.qkv.weight"].nbytes
    assert stats["seconds"] > 0 and stats["rate"] > 0

    with vault.open(key, expected_of(tensors)) as session:
        assert session.complete
        for name, tensor in tensors.items():
            view = session.get(name, tuple(tensor.shape), dtype)
            assert view is not None and view.dtype == dtype and torch.equal(view, tensor)
            vma = vma_holding(view.data_ptr())
            assert vma.path == os.path.join(folder_of(vault, key), layer_file_name(name))
            assert vma.perms.startswith("r-") and vma.is_shared  # PROT_READ, MAP_SHARED: page cache
        assert session.stats["layers_hit"] == 3 and session.stats["layers_written"] == 0


def test_put_returns_a_view_of_the_file_it_wrote(tmp_path):
    vault, key = Vault(tmp_path / "root"), key_for("put")
    merged = torch.randn(SHAPE)
    with vault.open(key) as session:
        view = session.put("w", merged)
        assert torch.equal(view, merged)
        assert vma_holding(view.data_ptr()).path == os.path.join(folder_of(vault, key), layer_file_name("w"))
        assert session.get("w", SHAPE, torch.float32) is not None
        assert session.get("other", SHAPE, torch.float32) is None
        assert session.stats["layers_missed"] == 1


def test_a_write_into_a_served_view_faults_instead_of_copying(tmp_path):
    code = """
        import sys, torch
        from hostmem.vault import Vault, cache_key
        key = cache_key({"shards": []}, [], "float32", "ro")
        with Vault(sys.argv[1]).open(key) as session:
            view = session.put("w", torch.ones(256, 256))
            print("written", flush=True)
            view.add_(1.0)
        print("no fault")
    """
    done = run_python(code, str(tmp_path / "root"))
    assert "written" in done.stdout and "no fault" not in done.stdout
    assert done.returncode == -signal.SIGSEGV


def test_served_views_and_loaded_bases_are_advised_for_huge_pages(tmp_path):
    """A layer faulted in 2 MiB at a time keeps 2 MiB folios in the page cache, so every
    later start maps it with one entry per 2 MiB (the same for a base loaded read-only)."""
    if not transparent_huge_pages():
        pytest.skip("this kernel has no transparent huge pages")
    from hostmem import load_readonly

    vault, key, tensors = Vault(tmp_path / "root"), key_for("huge"), layers()
    build(vault, key, tensors)
    with vault.open(key, expected_of(tensors)) as session:
        name, tensor = next(iter(tensors.items()))
        view = session.get(name, tuple(tensor.shape), tensor.dtype)
        assert "hg" in vma_holding(view.data_ptr()).vm_flags
    base = load_readonly(os.path.join(folder_of(vault, key), layer_file_name(name)))[name]
    assert "hg" in vma_holding(base.data_ptr()).vm_flags


def test_layout_manifest_records_every_layer_and_names_files_by_hash(tmp_path):
    vault, key = Vault(tmp_path / "root"), key_for("layout")
    odd = {"../../escape/name": torch.randn(4, 4), "a/b c\n.weight": torch.randn(8).half()}
    build(vault, key, odd)
    folder = folder_of(vault, key)
    assert sorted(os.listdir(folder)) == sorted(["manifest.json", "verified.json"] + [layer_file_name(n) for n in odd])
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    with open(os.path.join(folder, "manifest.json")) as handle:
        manifest = json.load(handle)
    assert manifest["key"] == key.hex and manifest["complete"] is True
    assert manifest["inputs"]["merge_policy"] == "test"
    assert manifest["created"] <= manifest["last_used"]
    assert manifest["total_bytes"] == sum(os.path.getsize(os.path.join(folder, layer_file_name(n))) for n in odd)
    by_name = {e["name"]: e for e in manifest["layers"]}
    for name, tensor in odd.items():
        entry, path = by_name[name], os.path.join(folder, layer_file_name(name))
        header = read_header(path)
        assert entry["file"] == layer_file_name(name) and entry["size"] == os.path.getsize(path)
        assert entry["header_sha256"] == header.header_sha256 and len(entry["crc32"]) == 8
        assert entry["shape"] == list(tensor.shape) and stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert header.data_offset % 4096 == 0  # tensor pages are the file's pages
        with safe_open(path, framework="pt") as reader:  # a plain safetensors file for any tool
            assert torch.equal(reader.get_tensor(name), tensor)


def test_complete_tracks_expected_layers(tmp_path):
    vault, key, tensors = Vault(tmp_path / "root"), key_for("complete"), layers()
    names = list(tensors)
    with vault.open(key, expected_of(tensors)) as session:
        session.put(names[0], tensors[names[0]])
        assert not session.complete
    with vault.open(key) as session:
        assert not session.complete  # the manifest said incomplete
    with vault.open(key, expected_of(tensors)) as session:
        assert session.get(names[0], SHAPE, torch.bfloat16) is not None
        for name in names[1:]:
            session.put(name, tensors[name])
        assert session.complete
    with vault.open(key) as session:
        assert session.complete


def test_a_shape_mismatch_drops_the_whole_combination(tmp_path, capfd):
    vault, key, tensors = Vault(tmp_path / "root"), key_for("shape"), layers()
    build(vault, key, tensors)
    first, second = list(tensors)[:2]
    with vault.open(key) as session:
        assert session.get(first, (48, 64), torch.bfloat16) is None
        assert session.get(second, SHAPE, torch.bfloat16) is None  # the others went too
        assert "was asked for" in session.stats["dropped"]
        assert os.listdir(folder_of(vault, key)) == []
    assert "dropped the whole combination" in capfd.readouterr().err
    assert not os.path.exists(folder_of(vault, key))  # nothing rebuilt, nothing left


def test_expected_dtype_differing_from_the_cache_drops_it_at_open(tmp_path):
    vault, key, tensors = Vault(tmp_path / "root"), key_for("dtype"), layers()
    build(vault, key, tensors)
    wanted = {n: (SHAPE, torch.float16) for n in tensors}
    with vault.open(key, wanted) as session:
        assert session.stats["dropped"] and not session.layers
        assert all(session.get(n, SHAPE, torch.float16) is None for n in tensors)


def test_a_truncated_layer_file_is_never_served(tmp_path):
    vault, key, tensors = Vault(tmp_path / "root"), key_for("torn"), layers(torch.float32)
    build(vault, key, tensors)
    name = list(tensors)[1]
    path = os.path.join(folder_of(vault, key), layer_file_name(name))
    os.truncate(path, os.path.getsize(path) - 100)
    with vault.open(key, expected_of(tensors)) as session:
        assert session.stats["layers_failed_check"] == [name] and not os.path.exists(path)
        assert session.get(name, SHAPE, torch.float32) is None
        for n, t in tensors.items():  # the others are served; the torn one is rebuilt
            if n != name:
                assert torch.equal(session.get(n, SHAPE, torch.float32), t)
        session.put(name, tensors[name])
        assert session.complete


def test_a_layer_replaced_after_adoption_is_not_served(tmp_path):
    """Adopted at open, swapped before get: get re-checks the header it maps."""
    vault, key, tensors = Vault(tmp_path / "root"), key_for("swap"), layers(torch.float32)
    build(vault, key, tensors)
    other = Vault(tmp_path / "other")
    other_key = key_for("donor")
    donor = {n: t + 1 for n, t in tensors.items()}
    build(other, other_key, donor)
    name = list(tensors)[0]
    with vault.open(key, expected_of(tensors)) as session:
        os.replace(
            os.path.join(folder_of(other, other_key), layer_file_name(name)),
            os.path.join(folder_of(vault, key), layer_file_name(name)),
        )
        assert session.get(name, SHAPE, torch.float32) is None
        assert "header changed" in session.stats["dropped"]


def test_a_damaged_manifest_drops_the_combination(tmp_path):
    vault, key, tensors = Vault(tmp_path / "root"), key_for("manifest"), layers()
    build(vault, key, tensors)
    with open(os.path.join(folder_of(vault, key), "manifest.json"), "w") as handle:
        handle.write('{"format": "hostmem-lora-merge-cache", "format_vers')
    with vault.open(key, expected_of(tensors)) as session:
        assert "not JSON" in session.stats["dropped"] and not session.layers


@pytest.mark.parametrize("file, text", [
    ("manifest.json", "[" * 100_000 + "]" * 100_000),  # nested past the parser's recursion limit
    ("damage.json", '{"problems": 5}'),  # JSON of another shape
    ("verified.json", "[" * 100_000 + "]" * 100_000),
])
def test_a_small_file_of_the_cache_damaged_in_any_shape_never_stops_a_start(tmp_path, file, text):
    """Whatever a damaged or planted file holds, a start drops or rebuilds what it vouched for
    and goes on, with the layers it serves verified: never a traceback."""
    vault, key, tensors = Vault(tmp_path / "root"), key_for(f"shape-{file}"), layers()
    build(vault, key, tensors)
    with open(os.path.join(folder_of(vault, key), file), "w") as handle:
        handle.write(text)
    with vault.open(key, expected_of(tensors)) as session:
        served = {n: session.get(n, SHAPE, t.dtype) for n, t in tensors.items()}
        if file == "manifest.json":
            assert "not JSON" in session.stats["dropped"] and not session.layers
        else:  # hints: a damage record has every layer read again; the memo's own stamps stand in the manifest
            assert session.stats["layers_verified"] == (len(tensors) if file == "damage.json" else 0)
            assert all(torch.equal(served[n], tensors[n]) for n in tensors)


def test_the_root_is_created_private(tmp_path):
    root = tmp_path / "a" / "root"
    vault = Vault(root)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(vault.cache).st_mode) == 0o700


def test_a_root_writable_by_others_is_refused_sticky_or_not_and_the_advice_is_safe(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    for mode in (0o777, 0o1777, 0o770):  # a sticky folder still takes others' new entries
        os.chmod(root, mode)
        with pytest.raises(VaultError, match=r"shared: a cache folder writable by .*chmod go-w") as refused:
            Vault(root)
        assert "+t" not in str(refused.value)
    os.chmod(root, 0o1777 & ~0o022)  # what the advice leaves
    assert Vault(root).cache.startswith(str(root))


def test_a_cache_folder_owned_by_another_user_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to give a folder to another user")
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    planted = root / "lora_merge_cache"
    planted.mkdir(mode=0o700)
    os.chown(planted, 54321, 54321)
    with pytest.raises(VaultError, match=r"lora_merge_cache: owned by uid 54321.*choose a cache root of your own"):
        Vault(root)


def test_a_root_under_a_regular_file_is_an_error_that_names_the_file(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    for root in (blocker / "root", blocker / "deeper" / "root"):
        with pytest.raises(VaultError) as refused:
            Vault(root)
        message = str(refused.value)
        assert message.startswith(f"{root}: cannot create the LoRA merge cache folder: ")
        assert f": {blocker} is a file, not a folder. Choose a cache root" in message
        assert "--root DIR" in message and "HOSTMEM_CACHE_ROOT" in message
    assert blocker.read_text() == ""


def test_a_root_where_no_folder_can_be_made_is_an_error_that_says_so():
    root = f"/proc/hostmem-vault-test-{os.getpid()}"
    with pytest.raises(VaultError) as refused:
        Vault(root)
    message = str(refused.value)
    assert message.startswith(f"{root}: cannot create the LoRA merge cache folder: /proc does not accept new folders")
    assert "disk-backed filesystem" in message and "HOSTMEM_CACHE_ROOT" in message


def test_a_root_on_tmpfs_is_refused_and_nothing_is_created():
    mount = filesystem_of("/dev/shm")
    if mount is None or mount.fs_type != "tmpfs":
        pytest.skip("/dev/shm is not tmpfs here")
    root = f"/dev/shm/hostmem-vault-test-{os.getpid()}"
    with pytest.raises(VaultError, match=r"on tmpfs.*cannot drop without swap.*HOSTMEM_CACHE_ROOT"):
        Vault(root)
    assert not os.path.exists(root)


def test_a_symlinked_layer_file_is_refused_and_its_target_untouched(tmp_path):
    vault, key, tensors = Vault(tmp_path / "root"), key_for("link"), layers()
    build(vault, key, tensors)
    target = tmp_path / "elsewhere.safetensors"
    target.write_bytes(b"precious")
    path = os.path.join(folder_of(vault, key), layer_file_name(list(tensors)[0]))
    os.unlink(path)
    os.symlink(target, path)
    with pytest.raises(VaultError, match=r"is a symlink.*cache rm"):
        vault.open(key)
    assert target.read_bytes() == b"precious"
    with vault.open(key_for("after")) as session:  # the refusal released the key's lock
        assert session.put("x", torch.zeros(2)) is not None


def test_a_symlinked_combination_folder_is_refused(tmp_path):
    vault, key = Vault(tmp_path / "root"), key_for("linkdir")
    (tmp_path / "planted").mkdir()
    os.symlink(tmp_path / "planted", folder_of(vault, key))
    with pytest.raises(VaultError, match="is a symlink") as refused:
        vault.open(key)
    # the advice is a command that works: `hostmem cache rm` walks the same link and is refused too
    assert f"`rm {folder_of(vault, key)}`" in str(refused.value) and "cache rm" not in str(refused.value)


def test_one_root_under_two_spellings_is_one_root_to_the_claims(tmp_path, monkeypatch):
    """A root opened through a link to it holds the same lock files: a second open of a key
    open through the other spelling is refused at once (it waited for its own lock, 30
    minutes by default, saying another process held it)."""
    monkeypatch.setenv("HOSTMEM_LOCK_TIMEOUT", "5")
    os.symlink(tmp_path / "root", tmp_path / "link")
    vault, key = Vault(tmp_path / "root"), key_for("spellings")
    with vault.open(key):
        with pytest.raises(VaultError, match="already open in this process"):
            Vault(tmp_path / "link").open(key)


def test_opening_a_key_twice_in_one_process_is_an_error_not_a_deadlock(tmp_path):
    vault, key = Vault(tmp_path / "root"), key_for("twice")
    with vault.open(key):
        with pytest.raises(VaultError, match="already open in this process"):
            vault.open(key)
    with vault.open(key):
        pass


def test_a_closed_session_refuses_use_and_a_key_must_be_hex(tmp_path):
    vault = Vault(tmp_path / "root")
    session = vault.open(key_for("closed"))
    session.close()
    with pytest.raises(VaultError, match="already closed"):
        session.get("w", SHAPE, torch.float32)
    with pytest.raises(VaultError, match="not a cache key"):
        vault.open("../../etc")



def test_a_checksum_given_to_put_is_recorded_as_is_and_verify_checks_it(tmp_path):
    """A caller that took the CRC-32 already (on every core) passes it; verify reads the data back."""
    vault, tensors = Vault(tmp_path / "root"), layers(count=2)
    true_crc = {name: crc32_of(tensor_bytes(tensor)) for name, tensor in tensors.items()}
    damaged = next(iter(tensors))
    for tag, given in (("right", true_crc), ("wrong", {**true_crc, damaged: true_crc[damaged] ^ 1})):
        key = key_for(tag)
        with vault.open(key, expected_of(tensors)) as session:
            for name, tensor in tensors.items():
                assert session.put(name, tensor, given[name]) is not None, session.last_error
            entries = session.layers
        assert {n: e.crc32 for n, e in entries.items()} == {n: f"{c:08x}" for n, c in given.items()}
        for name, entry in entries.items():  # the bytes on disk are right either way
            assert data_crc32(os.path.join(folder_of(vault, key), entry.file)) == f"{true_crc[name]:08x}"
        assert verify_combination(vault.cache, key.hex).state == ("ok" if given is true_crc else "bad")
