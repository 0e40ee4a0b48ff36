"""``hostmem cache ls | verify | prune | rm KEY`` on real cache folders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from hostmem.safetensors.mapping import read_header
from hostmem.vault import Vault, adapter_identity, cache_key
from hostmem.vault.locks import KeyLock
from hostmem.vault.layer_file import layer_file_name
from planners.cli import main
from tests.conftest import write_safetensors


def build(root, tag: str, tmp_path, count=2):
    seed = float(sum(tag.encode()))  # a different tag is different content, hence another key
    shard = write_safetensors(tmp_path / f"{tag}-dit.safetensors", {"w": torch.full((2,), seed)})
    lora = write_safetensors(tmp_path / f"{tag}-turbo.safetensors", {"a": torch.full((2,), seed)})
    from hostmem.vault import base_identity

    key = cache_key(base_identity([shard]), [adapter_identity(lora, 0.8, None)], "bfloat16", "fp32-sum")
    layers = {f"blocks.{i}.w": torch.randn(32, 32) for i in range(count)}
    with Vault(root).open(key, {n: (tuple(t.shape), t.dtype) for n, t in layers.items()}) as session:
        for name, tensor in layers.items():
            session.put(name, tensor)
    return key


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def cli_with_env(environ: dict, *argv) -> subprocess.CompletedProcess:
    """``hostmem *argv`` in a fresh process whose environment is ours with ``environ`` on top (a
    value of None unsets that variable)."""
    env = {k: v for k, v in {**os.environ, **environ}.items() if v is not None}
    return subprocess.run([sys.executable, "-m", "planners.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=60)


def test_ls_shows_each_combination_in_text_and_json(tmp_path, capsys):
    root = str(tmp_path / "root")
    key = build(root, "one", tmp_path)
    code, out, _ = cli(capsys, "cache", "ls", "--root", root)
    assert code == 0
    line = next(l for l in out.splitlines() if l.startswith(key.short))
    assert "complete" in line and "KiB" in line and "one-dit.safetensors" in line and "one-turbo.safetensors x0.8" in line
    code, out, _ = cli(capsys, "cache", "ls", "--root", root, "--json")
    listing = json.loads(out)
    (combo,) = listing["combinations"]
    assert combo["key"] == key.hex and combo["state"] == "complete" and combo["layers"] == 2
    assert isinstance(combo["bytes"], int) and combo["bytes"] == listing["total_bytes"] > 2 * 32 * 32 * 4
    assert combo["inputs"]["adapters"][0]["strength"] == 0.8


@pytest.mark.parametrize("edit", [
    {"inputs": {"base": "a text where a record was"}},
    {"inputs": {"base": {"shards": [{"size": 1}]}, "adapters": ["a text"]}},
    {"inputs": ["a list"]},
    {"last_used": 1e300, "created": float("nan")},
])
def test_ls_of_a_hand_edited_manifest_says_what_it_can(tmp_path, capsys, edit):
    """What ls shows of a manifest a person edited is "?" where it no longer says, never a traceback."""
    root = str(tmp_path / "root")
    key = build(root, "edited", tmp_path)
    path = os.path.join(root, "lora_merge_cache", key.hex, "manifest.json")
    with open(path) as handle:
        manifest = json.load(handle)
    manifest.update(edit)
    with open(path, "w") as handle:
        json.dump(manifest, handle)
    code, out, err = cli(capsys, "cache", "ls", "--root", root)
    assert code == 0 and key.short in out and "Traceback" not in err


def test_a_root_on_a_filesystem_that_makes_no_folders_says_so(tmp_path):
    """/proc refuses a new folder with ENOENT: said as such, not as a folder removed meanwhile."""
    from hostmem.vault import VaultError

    with pytest.raises(VaultError, match=r"/proc/lora_merge_cache: cannot create .* /proc does not accept"):
        Vault("/proc")


def test_ls_of_a_root_never_used_creates_nothing(tmp_path, capsys):
    root = tmp_path / "empty-root"
    root.mkdir()
    code, out, _ = cli(capsys, "cache", "ls", "--root", str(root))
    assert code == 0 and "no cached LoRA merges" in out and os.listdir(root) == []


@pytest.mark.parametrize("action", ["ls", "verify", "prune"])
def test_a_root_that_is_missing_or_a_file_exits_2_saying_so(tmp_path, capsys, action):
    missing, file = tmp_path / "nothing-here", tmp_path / "a-file"
    file.write_text("x")
    code, _, err = cli(capsys, "cache", action, "--root", str(missing))
    assert code == 2 and "no such folder" in err and "Traceback" not in err and not missing.exists()
    code, _, err = cli(capsys, "cache", action, "--root", str(file))
    assert code == 2 and "is a file, not a folder" in err and file.read_text() == "x"


@pytest.mark.parametrize("action", ["ls", "verify", "prune"])
def test_a_default_root_that_is_a_file_exits_2_naming_the_variable(tmp_path, action):
    """$HOSTMEM_CACHE_ROOT pointing at a file is the same typo as such a --root, not an empty cache."""
    file = tmp_path / "deploy.yaml"
    file.write_text("x")
    done = cli_with_env({"HOSTMEM_CACHE_ROOT": str(file)}, "cache", action)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"hostmem: error: HOSTMEM_CACHE_ROOT={file}: is a file, not a folder; point it at the cache root folder "
        "(the one holding lora_merge_cache), or give --root DIR"]
    assert file.read_text() == "x"


@pytest.mark.parametrize("action", ["ls", "verify"])
def test_a_default_root_never_made_says_nothing_was_cached_yet_and_makes_nothing(tmp_path, action):
    """A fresh machine has no ~/.cache/hostmem: that is no error (exit 0), but it is said as it is."""
    missing = tmp_path / "never-built"
    done = cli_with_env({"HOSTMEM_CACHE_ROOT": str(missing)}, "cache", action)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"nothing cached yet under {missing} (HOSTMEM_CACHE_ROOT): the folder does not exist")
    home = tmp_path / "home"
    home.mkdir()
    done = cli_with_env({"HOSTMEM_CACHE_ROOT": None, "XDG_CACHE_HOME": None, "HOME": str(home)}, "cache", action)
    assert done.returncode == 0, done.stderr
    default = home / ".cache" / "hostmem"
    assert done.stdout.startswith(f"nothing cached yet under {default}: the folder does not exist")
    assert not missing.exists() and os.listdir(home) == []


@pytest.mark.parametrize("action", [["ls"], ["verify"], ["prune"], ["rm", "abc"]], ids=["ls", "verify", "prune", "rm"])
def test_a_root_whose_cache_folder_is_a_file_exits_2_saying_so(tmp_path, capsys, action):
    root = tmp_path / "root"
    root.mkdir()
    (root / "lora_merge_cache").write_text("x")
    code, out, err = cli(capsys, "cache", *action, "--root", str(root))
    assert code == 2 and out == ""
    assert err.splitlines() == [
        f"hostmem: error: {root / 'lora_merge_cache'}: is a file, where the LoRA merge cache's folder belongs; "
        "move it away (the next build makes the folder), or give the cache root that holds the cache"]


def cache_files(cache: str) -> dict[str, int]:
    """Every entry of the cache folder, by name, with its inode."""
    return {name: os.lstat(os.path.join(cache, name)).st_ino for name in sorted(os.listdir(cache))}


def test_ls_and_verify_are_queries_that_change_no_file(tmp_path, capsys):
    root = str(tmp_path / "root")
    key = build(root, "query", tmp_path)
    cache = os.path.join(root, "lora_merge_cache")
    for left_behind in (False, True):
        if left_behind:  # a lock file whose holder has gone
            left = KeyLock(os.path.join(cache, f"{key.hex}.lock"))
            left.acquire()
            left.release()
        before = cache_files(cache)
        assert (f"{key.hex}.lock" in before) == left_behind
        for argv in (["ls"], ["ls", "--json"], ["verify"]):
            code, out, _ = cli(capsys, "cache", *argv, "--root", root)
            assert code == 0 and "in use" not in out
            assert cache_files(cache) == before, f"hostmem cache {' '.join(argv)} changed the cache"


def test_verify_finds_a_flipped_byte_that_adoption_does_not_look_for(tmp_path, capsys):
    root = str(tmp_path / "root")
    good, bad = build(root, "good", tmp_path), build(root, "bad", tmp_path)
    assert cli(capsys, "cache", "verify", "--root", root)[0] == 0
    path = os.path.join(root, "lora_merge_cache", bad.hex, layer_file_name("blocks.1.w"))
    offset = read_header(path).data_offset + 100
    with open(path, "r+b") as handle:  # same size, same header: only the checksum can tell
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))
    code, out, _ = cli(capsys, "cache", "verify", "--root", root)
    assert code == 1
    assert f"{bad.short}  bad" in out and f"{good.short}  ok" in out
    assert f"{path}: content checksum differs" in out and "hostmem cache rm KEY" in out
    code, out, _ = cli(capsys, "cache", "verify", "--root", root, good.hex[:8], "--json")
    assert code == 0 and [c["state"] for c in json.loads(out)["combinations"]] == ["ok"]


def test_a_dead_writers_temporary_file_is_a_note_never_damage_that_prune_acts_on(tmp_path, capsys):
    """A start killed while it rewrote a small file of a sealed combination leaves a temporary
    beside its intact layers: verify names it, and neither it nor prune calls them damaged."""
    from hostmem.vault.durable import TMP_PREFIX

    root = str(tmp_path / "root")
    key = build(root, "leftover", tmp_path)
    folder = os.path.join(root, "lora_merge_cache", key.hex)
    with open(os.path.join(folder, f"{TMP_PREFIX}4242-0badf00d"), "wb") as handle:
        handle.write(b"{")
    code, out, _ = cli(capsys, "cache", "verify", "--root", root)
    assert code == 0 and f"{key.short}  ok" in out and "leftover temporary file" in out
    assert not os.path.exists(os.path.join(folder, "damage.json"))
    code, out, _ = cli(capsys, "cache", "prune", "--root", root)
    assert code == 0 and key.short not in out and os.path.isdir(folder)


def test_verify_calls_a_combination_a_shared_build_is_writing_in_use_and_records_nothing(tmp_path, capsys):
    """A share holds the key's lock shared while it writes, as verify does: its own lock tells."""
    from hostmem.vault.combinations import lock_path

    root = str(tmp_path / "root")
    key = build(root, "sharing", tmp_path)
    cache = os.path.join(root, "lora_merge_cache")
    share = KeyLock(f"{lock_path(cache, key.hex)}.0of2")
    assert share.acquire()
    try:
        code, out, _ = cli(capsys, "cache", "verify", "--root", root)
        assert f"{key.short}  in use" in out
        assert not os.path.exists(os.path.join(cache, key.hex, "damage.json"))
    finally:
        share.release(remove=True)
    code, out, _ = cli(capsys, "cache", "verify", "--root", root)
    assert code == 0 and f"{key.short}  ok" in out


def test_prune_removes_interrupted_builds_and_then_lru_beyond_max_size(tmp_path, capsys):
    root = str(tmp_path / "root")
    old, new = build(root, "old", tmp_path), build(root, "new", tmp_path)
    os.unlink(os.path.join(root, "lora_merge_cache", new.hex, "manifest.json"))  # as if killed
    code, out, _ = cli(capsys, "cache", "prune", "--root", root, "--dry-run")
    assert code == 0 and f"would remove {new.short}" in out and "interrupted build" in out
    assert os.path.isdir(os.path.join(root, "lora_merge_cache", new.hex))
    code, out, _ = cli(capsys, "cache", "prune", "--root", root)
    assert f"removed {new.short}" in out and old.short not in out
    assert not os.path.exists(os.path.join(root, "lora_merge_cache", new.hex))
    code, out, _ = cli(capsys, "cache", "prune", "--root", root, "--max-size", "1KiB")
    assert f"removed {old.short}" in out and "least recently used" in out
    assert not [n for n in os.listdir(os.path.join(root, "lora_merge_cache")) if len(n) == 64]


def test_prune_removes_the_records_no_combination_left_needs(tmp_path, capsys):
    """Conversion records serve only starts whose combination is cached: once the last
    combination naming an adapter's digest goes, so does its record (and a record that
    names no digest); a record of a combination still there, or one just written (its
    combination may be being built), stays and still serves."""
    from hostmem.vault.records import FRESH_SECONDS
    from lora_cache.adapters.conversion_memo import ConversionMemo, record_of

    root = str(tmp_path / "root")
    cache = os.path.join(root, "lora_merge_cache")
    build(root, "kept", tmp_path)
    gone = build(root, "gone", tmp_path)
    memo = ConversionMemo([root])
    names = {}
    for tag in ("kept", "gone", "fresh"):
        lora = tmp_path / f"{tag}-turbo.safetensors"
        if not lora.exists():
            write_safetensors(lora, {"a": torch.zeros(3)})
        names[tag] = memo.key(str(lora), "diffusers x.y FluxPipeline.lora_state_dict", ("transformer",))
        memo.store(names[tag], record_of("kohya-flux", "diffusers x.y FluxPipeline.lora_state_dict"))
    records = os.path.join(cache, "conversions")
    with open(os.path.join(records, "older.json"), "w") as handle:  # as an older version wrote them: no digest
        json.dump(record_of("kohya-flux", "diffusers 0.30"), handle)
    aged = time.time() - FRESH_SECONDS - 60
    for name in ("kept", "gone"):
        os.utime(os.path.join(records, f"{names[name]}.json"), (aged, aged))
    os.utime(os.path.join(records, "older.json"), (aged, aged))
    os.unlink(os.path.join(cache, gone.hex, "manifest.json"))  # an interrupted build: prune removes it

    code, out, _ = cli(capsys, "cache", "ls", "--root", root)  # ls says what prune would take
    assert code == 0 and "records: 4 (4 conversion)" in out and "2 of them" in out  # gone names no inputs now
    code, out, _ = cli(capsys, "cache", "ls", "--root", root, "--json")
    listed = json.loads(out)["records"]
    assert (listed["count"], listed["stale"], listed["kinds"]) == (4, 2, {"conversions": 4}) and listed["bytes"] > listed["stale_bytes"] > 0

    code, out, _ = cli(capsys, "cache", "prune", "--root", root, "--dry-run")
    assert code == 0 and f"would remove {gone.short}" in out
    assert f"would remove conversions/{names['gone']}.json" in out and "no combination left uses its input" in out
    assert "would remove conversions/older.json" in out and "names no input" in out
    assert names["kept"] not in out and names["fresh"] not in out and "would remove 2 record(s)" in out
    assert len(os.listdir(records)) == 4
    code, out, _ = cli(capsys, "cache", "prune", "--root", root)
    assert code == 0 and "removed 2 record(s) no combination left needs" in out
    assert sorted(os.listdir(records)) == sorted(f"{names[t]}.json" for t in ("kept", "fresh"))
    assert ConversionMemo([root]).load(names["kept"]) is not None  # what stays still serves
    code, out, _ = cli(capsys, "cache", "ls", "--root", root)
    assert "records: 2 (2 conversion)" in out and "no combination needs" not in out


def test_prune_never_follows_a_records_folder_that_is_a_link(tmp_path, capsys):
    """A ``conversions`` link planted in the cache would point prune at someone else's files:
    it refuses, naming the folder, and removes nothing there."""
    root = str(tmp_path / "root")
    key = build(root, "one", tmp_path)
    os.unlink(os.path.join(root, "lora_merge_cache", key.hex, "manifest.json"))  # what prune would remove
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    victim = elsewhere / "settings.json"
    victim.write_text("{}")
    aged = time.time() - 7200
    os.utime(victim, (aged, aged))
    link = os.path.join(root, "lora_merge_cache", "conversions")
    os.symlink(elsewhere, link)
    code, out, _ = cli(capsys, "cache", "ls", "--root", root)  # ls lists the rest and names the problem
    assert code == 0 and key.short in out and f"records: {link}: is a symlink" in out
    code, _, err = cli(capsys, "cache", "prune", "--root", root)
    assert code != 0 and link in err and "is a symlink" in err and "Traceback" not in err
    assert victim.exists() and os.path.isdir(os.path.join(root, "lora_merge_cache", key.hex))  # nothing removed


HOLDER = textwrap.dedent(
    """
    import sys
    from hostmem.vault import Vault
    with Vault(sys.argv[1]).open(sys.argv[2]):
        print("holding", flush=True)
        sys.stdin.read()
    """
)


def test_rm_by_prefix_and_never_one_in_use(tmp_path, capsys):
    root = str(tmp_path / "root")
    first, second = build(root, "first", tmp_path), build(root, "second", tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, root, second.hex], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        code, _, err = cli(capsys, "cache", "rm", "--root", root, second.hex[:10])
        assert code == 2 and "in use (a process is building it, or serves weights from it" in err
        assert "stop that process" in err
        code, out, _ = cli(capsys, "cache", "ls", "--root", root, "--json")
        states = {c["key"]: c["state"] for c in json.loads(out)["combinations"]}
        assert states == {first.hex: "complete", second.hex: "in use"}
        assert cli(capsys, "cache", "prune", "--root", root, "--all")[1].count("removed") == 2  # one line + total
    finally:
        holder.communicate("", timeout=30)
    assert os.path.isdir(os.path.join(root, "lora_merge_cache", second.hex))
    code, out, _ = cli(capsys, "cache", "rm", "--root", root, second.hex[:10])
    assert code == 0 and f"removed {second.hex}" in out
    code, _, err = cli(capsys, "cache", "rm", "--root", root, "ffff")
    assert code == 2 and "no combination whose key starts with 'ffff'" in err


def test_the_root_comes_from_hostmem_cache_root(tmp_path):
    root = str(tmp_path / "from-env")
    key = build(root, "env", tmp_path)
    done = cli_with_env({"HOSTMEM_CACHE_ROOT": root}, "cache", "ls", "--json")
    assert done.returncode == 0, done.stderr
    assert [c["key"] for c in json.loads(done.stdout)["combinations"]] == [key.hex]


def test_a_tmpfs_root_is_a_one_line_error(tmp_path, capsys):
    from hostmem.procfs import filesystem_of

    mount = filesystem_of("/dev/shm")
    if mount is None or mount.fs_type != "tmpfs":
        pytest.skip("/dev/shm is not tmpfs here")
    root = f"/dev/shm/hostmem-cli-test-{os.getpid()}"
    os.makedirs(os.path.join(root, "lora_merge_cache"))
    try:
        code, _, err = cli(capsys, "cache", "ls", "--root", root)
    finally:
        os.rmdir(os.path.join(root, "lora_merge_cache"))
        os.rmdir(root)
    assert code == 2 and err.startswith("hostmem: error: ") and "on tmpfs" in err


def _short(digest: str) -> str:
    """A content digest as `cache ls` shows it: its algorithm and 12 hex digits."""
    algorithm, hex_digits = digest.split(":")
    return f"{algorithm}:{hex_digits[:12]}"


def test_ls_shows_the_inputs_that_differ_between_combinations_that_look_alike(tmp_path, capsys):
    """Two builds of dit.safetensors + turbo.safetensors x0.8: the same line, different contents."""
    root = str(tmp_path / "root")
    keys = []
    for version in ("v1", "v2"):
        os.mkdir(tmp_path / version)
        shard = write_safetensors(tmp_path / version / "dit.safetensors", {"w": torch.full((2,), float(len(keys)))})
        lora = write_safetensors(tmp_path / version / "turbo.safetensors", {"a": torch.ones(2)})
        from hostmem.vault import base_identity

        key = cache_key(base_identity([shard]), [adapter_identity(lora, 0.8, None)], "bfloat16", "fp32-sum")
        with Vault(root).open(key, {"blocks.0.w": ((4, 4), torch.float32)}) as session:
            session.put("blocks.0.w", torch.randn(4, 4))
        keys.append(key)
    code, out, _ = cli(capsys, "cache", "ls", "--root", root)
    differs = [line.split("differs: ")[1] for line in out.splitlines() if "differs: " in line]
    assert code == 0 and len(differs) == 2, out
    assert all(d.startswith("base.shards.0.digest=") and "adapters" not in d for d in differs), differs
    assert {d.split("=")[1] for d in differs} == {_short(k.inputs["base"]["shards"][0]["digest"]) for k in keys}


def test_a_folder_renamed_by_hand_is_shown_by_a_key_cache_rm_takes(tmp_path, capsys):
    """A key folder copied under a name one digit off its own: ls, verify and its advice show
    each by a prefix no other key starts with (they showed the same twelve characters, and
    `hostmem cache rm` refused the one advised as ambiguous)."""
    import shutil

    root = str(tmp_path / "root")
    key = build(root, "a", tmp_path).hex
    cache = os.path.join(root, "lora_merge_cache")
    renamed = key[:-1] + ("0" if key[-1] != "0" else "1")
    shutil.copytree(os.path.join(cache, key), os.path.join(cache, renamed))
    code, out, _ = cli(capsys, "cache", "ls", "--root", root)
    assert code == 0 and key in out and renamed in out
    code, out, _ = cli(capsys, "cache", "verify", "--root", root)
    assert code == 1
    assert f"the manifest of key {key} in the folder of key {renamed} (moved or renamed)" in out, out
    advised = out.split("`hostmem cache rm KEY` (")[1].split(")")[0]
    assert advised == renamed
    code, out, err = cli(capsys, "cache", "rm", "--root", root, advised)
    assert code == 0, err
    assert os.path.isdir(os.path.join(cache, key)) and not os.path.exists(os.path.join(cache, renamed))


def test_cache_rm_of_an_empty_key_is_refused_saying_so(tmp_path, capsys):
    root = str(tmp_path / "root")
    build(root, "a", tmp_path)
    code, _, err = cli(capsys, "cache", "rm", "--root", root, "")
    assert code == 2 and "an empty key names no combination" in err, err
