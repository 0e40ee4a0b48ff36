"""Space: LRU eviction under max_size (never a combination in use), no room, full disks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import lora_cache
from hostmem.vault import Vault, VaultError, cache_key
from hostmem.vault.admin import prune, remove
from tests.conftest import write_safetensors
from tests.hostmem.vault.test_vault import build, expected_of
from tests.lora_cache.test_adapters import lora_change, write_adapter

SHAPE = (64, 48)


def key_for(tag: str):
    return cache_key({"shards": [{"path": f"/models/{tag}.safetensors"}]}, [], "float32", "space")


def tensors(count=3, rows=64) -> dict[str, torch.Tensor]:
    return {f"blocks.{i}.w": torch.randn(rows, 48) for i in range(count)}


def on_disk(vault: Vault) -> set[str]:
    return {n for n in os.listdir(vault.cache) if len(n) == 64}


def leftovers(folder: str) -> list[str]:
    return [n for n in os.listdir(folder) if n.startswith(".tmp-")] if os.path.isdir(folder) else []


COMBO_BYTES = 3 * (4096 + 64 * 48 * 4) + 2048  # three layer files and a manifest


def test_least_recently_used_combinations_go_beyond_max_size(tmp_path):
    vault = Vault(tmp_path / "root", max_size=int(2.5 * COMBO_BYTES))
    a, b, c = key_for("a"), key_for("b"), key_for("c")
    layers = tensors()
    build(vault, a, layers)
    build(vault, b, layers)
    with vault.open(a, expected_of(layers)) as session:  # a is now the most recently used
        assert session.get("blocks.0.w", SHAPE, torch.float32) is not None
    stats = build(vault, c, layers)
    assert stats["evicted"] == [b.hex] and stats["evicted_bytes"] > 3 * 64 * 48 * 4
    assert on_disk(vault) == {a.hex, c.hex}
    assert not os.path.exists(os.path.join(vault.cache, f"{b.hex}.lock"))


HOLDER = textwrap.dedent(
    """
    import sys
    from hostmem.vault import Vault
    with Vault(sys.argv[1]).open(sys.argv[2]) as session:
        print("holding", flush=True)
        sys.stdin.read()
    """
)


def test_a_combination_in_use_by_another_process_is_never_evicted(tmp_path):
    vault = Vault(tmp_path / "root", max_size=int(2.5 * COMBO_BYTES))
    a, b, c = key_for("a"), key_for("b"), key_for("c")
    layers = tensors()
    build(vault, a, layers)
    build(vault, b, layers)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, vault.root, a.hex], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        stats = build(vault, c, layers)  # a is least recently used, but open
        assert stats["evicted"] == [b.hex]
        assert on_disk(vault) == {a.hex, c.hex}
    finally:
        holder.communicate("", timeout=30)
    assert holder.returncode == 0


SERVER = textwrap.dedent(
    """
    import sys
    import lora_cache
    from lora_cache.placement.layers import checkpoint_module
    model = checkpoint_module([sys.argv[1]])
    stats = lora_cache.merge(model, [sys.argv[2]], cache_root=sys.argv[3], progress=False)
    print(stats.cache_key, flush=True)  # its session is closed; the merged weights are mapped views
    sys.stdin.readline()
    lora_cache.unmerge(model)
    print("unmerged", flush=True)
    sys.stdin.readline()
    """
)


def served_model(tmp_path) -> tuple[str, str]:
    """A mapped checkpoint of four 64 x 64 fp32 layers and an adapter on each."""
    gen = torch.Generator().manual_seed(3)
    base = write_safetensors(tmp_path / "base.safetensors",
                             {f"blocks.{i}.proj.weight": torch.randn(64, 64, generator=gen) for i in range(4)})
    changes = {f"blocks.{i}.proj": lora_change(64, 64, 4, i) for i in range(4)}
    return base, write_adapter(tmp_path / "turbo.safetensors", "comfyui", changes)


def test_a_combination_a_running_server_still_maps_is_never_evicted_nor_removed(tmp_path):
    base, adapter = served_model(tmp_path)
    root = str(tmp_path / "root")
    server = subprocess.Popen([sys.executable, "-c", SERVER, base, adapter, root],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        served = server.stdout.readline().strip()
        assert len(served) == 64, "the server did not merge"
        vault = Vault(root, max_size=4 * (4096 + 64 * 64 * 4) + 3 * (4096 + 64 * 48 * 4))  # one of the two fits
        assert not os.path.exists(os.path.join(vault.cache, f"{served}.lock"))  # no session holds it
        with vault.open(key_for("newer"), expected_of(tensors())) as session:
            assert session.stats["evicted"] == [] and not session.space.ok  # evicting it would free no disk
        assert served in on_disk(vault)
        assert [c.state for c in vault.combinations() if c.key == served] == ["in use"]
        with pytest.raises(VaultError, match="in use"):
            remove(vault.cache, served)
        assert prune(vault.cache, everything=True) == [] and served in on_disk(vault)
        server.stdin.write("\n")
        server.stdin.flush()
        assert server.stdout.readline().strip() == "unmerged"  # its views are gone, and the hold with them
        assert remove(vault.cache, served[:12]).key == served
        assert served not in on_disk(vault) and not os.path.exists(os.path.join(vault.cache, f"{served}.use"))
    finally:
        server.communicate("\n", timeout=30)
    assert server.returncode == 0


def test_views_alive_in_this_process_hold_their_combination_until_they_are_gone(tmp_path):
    from lora_cache.placement.layers import checkpoint_module

    base, adapter = served_model(tmp_path)
    root = tmp_path / "root"
    model = checkpoint_module([base])
    key = lora_cache.merge(model, [adapter], cache_root=root, progress=False).cache_key
    cache = Vault(root).cache
    view = model.get_submodule("blocks.1.proj").weight[:8]  # a slice of a merged weight outlives unmerge
    lora_cache.unmerge(model)
    with pytest.raises(VaultError, match="in use"):
        remove(cache, key)
    del view
    assert remove(cache, key).key == key


def test_no_room_answers_none_with_the_numbers_and_leaves_nothing(tmp_path):
    layers = tensors()
    build(Vault(tmp_path / "root"), key_for("kept"), layers)
    vault = Vault(tmp_path / "root", headroom=1 << 60)
    with vault.open(key_for("full"), expected_of(layers)) as session:
        assert not session.space.ok and session.space.needed == 3 * (4096 + 64 * 48 * 4)
        assert session.space.available < 0 and session.stats["needed_bytes"] == session.space.needed
        assert all(session.put(n, t) is None for n, t in layers.items())
        assert session.stats["layers_failed"] == 3 and session.stats["layers_written"] == 0
        message = session.last_error
    assert message.startswith("no room for the LoRA merge cache in ") and "needs 48.0 KiB" in message
    assert "hostmem cache prune" in message
    assert "in place" not in message  # what happens next is the caller's to say (fallback or not)
    assert on_disk(vault) == {key_for("kept").hex}  # evicting it could not have made room


def test_max_size_below_one_combination_refuses_the_build(tmp_path):
    vault = Vault(tmp_path / "root", max_size="20KiB")
    layers = tensors()
    with vault.open(key_for("small"), expected_of(layers)) as session:
        assert session.put("blocks.0.w", layers["blocks.0.w"]) is None
        assert "max_size 20.0 KiB" in session.last_error


def test_layers_beyond_the_expected_ones_stop_when_the_room_is_spent(tmp_path):
    vault = Vault(tmp_path / "root", max_size=2 * (4096 + 64 * 48 * 4))
    layers = tensors(count=3)
    first = {"blocks.0.w": layers["blocks.0.w"]}
    with vault.open(key_for("room"), expected_of(first)) as session:
        assert session.put("blocks.0.w", layers["blocks.0.w"]) is not None
        assert session.put("blocks.1.w", layers["blocks.1.w"]) is not None
        assert session.put("blocks.2.w", layers["blocks.2.w"]) is None
        assert "no room" in session.last_error and session.stats["needed_bytes"] == 4096 + 64 * 48 * 4
        sealed = sorted(e.file for e in session.layers.values())
    assert len(sealed) == 2
    assert sorted(os.listdir(session.folder)) == sorted(["manifest.json", "verified.json", *sealed])


FSIZE_CHILD = textwrap.dedent(
    """
    import os, resource, signal, sys, torch
    from hostmem.vault import Vault, cache_key
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    key = cache_key({"shards": []}, [], "float32", "fsize")
    with Vault(sys.argv[1]).open(key) as session:
        assert session.put("small", torch.ones(64, 64)) is not None
        assert session.put("large", torch.ones(1024, 512)) is None      # 2 MiB > RLIMIT_FSIZE
        assert session.put("small2", torch.ones(64, 64)) is None        # no retries after a failure
        print(session.last_error)
        print(sorted(os.listdir(session.folder)))
    """
)


def test_a_write_failing_mid_file_leaves_no_partial_file(tmp_path):
    done = subprocess.run([sys.executable, "-c", FSIZE_CHILD, str(tmp_path / "root")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "could not write layer 'large'" in done.stdout and "File too large" in done.stdout
    vault = Vault(tmp_path / "root")
    key = cache_key({"shards": []}, [], "float32", "fsize")
    folder = os.path.join(vault.cache, key.hex)
    assert len(os.listdir(folder)) == 3 and not leftovers(folder)  # the small layer, the manifest, the memo
    with vault.open(key) as session:
        assert torch.equal(session.get("small", (64, 64), torch.float32), torch.ones(64, 64))
        assert session.get("large", (1024, 512), torch.float32) is None


def test_a_full_disk_answers_none_and_leaves_no_partial_file(small_filesystem):
    vault = Vault(os.path.join(small_filesystem, "root"), headroom=0)
    wanted = {"blocks.0.w": torch.randn(64, 64)}
    with vault.open(key_for("disk"), expected_of(wanted)) as session:
        assert session.space.ok and session.put("blocks.0.w", wanted["blocks.0.w"]) is not None
        assert session.space.available >= 6 << 20, session.space  # the 4 MiB put below starts writing
        filler = os.path.join(small_filesystem, "filler")
        with open(filler, "wb") as handle:  # another tenant takes nearly all that is left
            os.posix_fallocate(handle.fileno(), 0, os.statvfs(filler).f_bavail * os.statvfs(filler).f_frsize - (512 << 10))
        assert session.put("blocks.1.w", torch.randn(1024, 1024)) is None  # 4 MiB into 512 KiB
        assert "No space left on device" in session.last_error
        assert f" left on the filesystem of {session.folder}; it filled during the build)" in session.last_error
        assert "Free disk space there, lower max_size" in session.last_error
        assert "`hostmem cache prune`" in session.last_error
        assert not leftovers(session.folder)
        assert sorted(os.listdir(session.folder)) == [next(iter(session.layers.values())).file]
    os.unlink(filler)
    with vault.open(key_for("too-big"), {"w": ((8192, 1024), torch.float32)}) as session:  # 32 MiB on 16 MiB
        assert not session.space.ok and session.space.needed > session.space.available
        assert session.put("w", torch.zeros(8192, 1024)) is None
        assert "no room" in session.last_error
    assert on_disk(vault) == {key_for("disk").hex}
