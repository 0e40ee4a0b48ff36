"""Real processes: two starts at once build once; a SIGKILL mid-build resumes to a correct cache."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from hostmem.vault import Vault, cache_key
from hostmem.vault.admin import verify_all

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

KEY = cache_key({"shards": []}, [], "float32", "concurrency")

# Builds (or adopts) `count` deterministic layers; reports stats and a digest of what it was served.
BUILDER = textwrap.dedent(
    """
    import ctypes, hashlib, json, os, sys, time, torch
    from hostmem.vault import Vault, cache_key
    root, go_file, delay, count, big = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    release = sys.argv[6]  # when set: once the lock is ours, say so and hold it until this file exists
    key = cache_key({"shards": []}, [], "float32", "concurrency")
    gen = torch.Generator().manual_seed(7)
    tensors = {f"blocks.{i}.w": torch.randn(128, 256, generator=gen) for i in range(count)}
    if big:
        tensors["blocks.big.w"] = torch.randn(big, 1024, 1024 // 4, generator=gen)
    expected = {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}
    print("ready", flush=True)
    while not os.path.exists(go_file):
        time.sleep(0.002)
    digest = hashlib.sha256()
    with Vault(root).open(key, expected) as session:
        if release and not os.path.exists(release):
            open(f"{release}.locked-by-{os.getpid()}", "w").close()
            while not os.path.exists(release):
                time.sleep(0.002)
        for name, tensor in tensors.items():
            view = session.get(name, tuple(tensor.shape), tensor.dtype)
            if view is None:
                time.sleep(delay)
                view = session.put(name, tensor)
            assert torch.equal(view, tensor), name
            digest.update((ctypes.c_ubyte * view.nbytes).from_address(view.data_ptr()))
        assert session.complete
        stats = dict(session.stats)
    print(json.dumps({"digest": digest.hexdigest(), "stats": stats}), flush=True)
    """
)


def start_builder(root, go_file, delay=0.0, count=4, big=0, release="") -> subprocess.Popen:
    child = subprocess.Popen(
        [sys.executable, "-c", BUILDER, str(root), str(go_file), str(delay), str(count), str(big), str(release)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "ready", child.stderr.read()
    return child


def finish(child: subprocess.Popen) -> tuple[dict, str]:
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1]), err


def expected_tensors(count=4) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {f"blocks.{i}.w": torch.randn(128, 256, generator=gen) for i in range(count)}


def file_digests(folder: str) -> dict[str, str]:
    return {n: hashlib.sha256(open(os.path.join(folder, n), "rb").read()).hexdigest() for n in sorted(os.listdir(folder))}


def wait_for_lock_holder(release, children: list[subprocess.Popen], timeout=60.0) -> subprocess.Popen:
    """The child that took the key's lock first (it says so with a file, then holds the lock)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in children:
            assert child.poll() is None, child.stderr.read()
            if os.path.exists(f"{release}.locked-by-{child.pid}"):
                return child
        time.sleep(0.002)
    raise AssertionError("no builder took the key's lock")


def wait_for_line(child: subprocess.Popen, text: str) -> list[str]:
    """Read the child's stderr until a line holds ``text``; return the lines read."""
    lines = []
    while not lines or text not in lines[-1]:
        lines.append(child.stderr.readline())
        assert lines[-1], f"the child ended without saying {text!r}: {''.join(lines)}"
    return lines


def test_two_processes_starting_at_once_build_once_and_serve_the_same_bytes(tmp_path):
    """The one that gets the lock holds it until the other has said that it waits: no timing involved."""
    root, go, release = tmp_path / "root", tmp_path / "go", tmp_path / "release"
    children = [start_builder(root, go, delay=0.01, release=release) for _ in range(2)]
    go.touch()
    builder = wait_for_lock_holder(release, children)
    (waiter,) = [c for c in children if c is not builder]
    said = wait_for_line(waiter, "in use by another process (most likely building it); waiting")
    assert waiter.poll() is None  # blocked on the lock the builder holds
    release.touch()
    (built, _), (adopted, err) = finish(builder), finish(waiter)

    assert (built["stats"]["layers_written"], built["stats"]["layers_hit"]) == (4, 0)  # one built all four
    assert (adopted["stats"]["layers_written"], adopted["stats"]["layers_hit"]) == (0, 4)  # the other adopted them
    assert adopted["stats"]["lock_wait_seconds"] > 0 and "adopting it" in "".join(said) + err
    assert built["digest"] == adopted["digest"]
    folder = os.path.join(root, "lora_merge_cache", KEY.hex)
    assert not [n for n in os.listdir(folder) if n.startswith(".tmp-")]
    assert [r.state for r in verify_all(os.path.join(root, "lora_merge_cache"))] == ["ok"]


def wait_for_temporary_file(folder: str, child: subprocess.Popen, sealed: int, timeout=30.0) -> str:
    """Wait until ``sealed`` layers are in place and the next one is being written."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert child.poll() is None, child.stderr.read()
        names = os.listdir(folder) if os.path.isdir(folder) else []
        tmp = [n for n in names if n.startswith(".tmp-")]
        if tmp and len([n for n in names if n.endswith(".safetensors") and n not in tmp]) == sealed:
            return tmp[0]
        time.sleep(0.0005)
    raise AssertionError("the build never started writing its large layer")


def test_a_build_killed_mid_write_resumes_from_its_sealed_layers(tmp_path):
    root, go = tmp_path / "root", tmp_path / "go"
    folder = os.path.join(root, "lora_merge_cache", KEY.hex)
    child = start_builder(root, go, count=4, big=32)  # 4 small layers, then a 32 MiB one
    go.touch()
    wait_for_temporary_file(folder, child, sealed=4)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL

    left = os.listdir(folder)
    assert "manifest.json" not in left and any(n.startswith(".tmp-") for n in left)  # torn, unsealed
    tensors = expected_tensors()
    gen = torch.Generator().manual_seed(7)
    for _ in range(4):
        torch.randn(128, 256, generator=gen)
    tensors["blocks.big.w"] = torch.randn(32, 1024, 256, generator=gen)
    expected = {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}

    with Vault(root).open(KEY, expected) as session:  # the kernel released the dead builder's lock
        assert session.stats["layers_resumed"] == 4 and not session.complete
        assert not [n for n in os.listdir(folder) if n.startswith(".tmp-")]
        for name, tensor in tensors.items():
            view = session.get(name, tuple(tensor.shape), tensor.dtype)
            view = view if view is not None else session.put(name, tensor)
            assert torch.equal(view, tensor), name
        assert (session.stats["layers_hit"], session.stats["layers_written"]) == (4, 1)
        assert session.complete
    assert [r.state for r in verify_all(os.path.join(root, "lora_merge_cache"))] == ["ok"]
    sealed = file_digests(folder)
    with Vault(root).open(KEY, expected) as session:
        assert session.complete and session.stats["layers_resumed"] == 0
    assert file_digests(folder).keys() == sealed.keys()


# Builds combination after combination until the stop file exists; prints how many.
_SEALER = textwrap.dedent(
    """
    import os, sys
    from hostmem.vault import Vault
    from tests.hostmem.vault.test_vault import build, key_for, layers

    root, stop = sys.argv[1], sys.argv[2]
    tensors, built = layers(count=6), 0
    print("ready", flush=True)
    while not os.path.exists(stop):
        build(Vault(root), key_for(f"busy-{built}"), tensors)
        built += 1
    print(built, flush=True)
    """
)


def test_sizing_the_cache_while_another_process_seals_layers_never_fails(tmp_path):
    """A start sizes the cache (for eviction) and ``cache ls`` lists it without any key's
    lock, while another process writes each layer to a temporary file and renames it as
    it seals: a file gone between the listing and its stat is not counted, never an error
    (before, the start that met one failed with FileNotFoundError)."""
    from hostmem.vault.combinations import cache_bytes, list_combinations

    vault = Vault(tmp_path / "root")
    stop = tmp_path / "stop"
    sealer = subprocess.Popen([sys.executable, "-c", _SEALER, str(tmp_path / "root"), str(stop)],
                              cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert sealer.stdout.readline().strip() == "ready"
        deadline, sizes = time.monotonic() + 2.0, set()
        while time.monotonic() < deadline:
            sizes.add(cache_bytes(vault.cache))
            assert all(c.problem is None for c in list_combinations(vault.cache))
    finally:
        stop.touch()
        out, err = sealer.communicate(timeout=60)
    assert sealer.returncode == 0, err
    assert int(out.strip()) >= 2 and len(sizes) >= 3, (out, sizes)  # it sized a cache that kept changing


def _tmpfs(point) -> bool:
    point.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(point)],
                          capture_output=True).returncode == 0


def test_a_flock_on_another_filesystems_file_of_the_same_inode_number_is_no_holder(tmp_path):
    """/proc/locks names a locked file MAJOR:MINOR:INODE: a process holding a file of another
    filesystem that happens to carry our lock file's inode number is no holder of our lock
    (where it was, a lock of ours could be taken for another user's, or the reverse)."""
    import fcntl

    from hostmem.vault.locks import lock_holders

    points = [tmp_path / "a", tmp_path / "b"]
    if os.geteuid() != 0 or not all(_tmpfs(p) for p in points):
        for p in points:
            subprocess.run(["umount", str(p)], capture_output=True)
        pytest.skip("needs root to mount two tmpfs filesystems")
    try:
        ours, theirs = points[0] / "key.lock", points[1] / "key.lock"
        ours.touch(), theirs.touch()
        if os.stat(ours).st_ino != os.stat(theirs).st_ino:
            pytest.skip("two fresh tmpfs mounts gave their first files different inode numbers")
        holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
            import fcntl, sys, time
            handle = open({str(theirs)!r}, "rb")
            fcntl.flock(handle, fcntl.LOCK_EX)
            print("held", flush=True)
            time.sleep(60)
            """)], stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "held"
            assert [pid for pid, _ in lock_holders(str(theirs))] == [holder.pid]
            assert lock_holders(str(ours)) == []  # asked just as its holder let go: none
            with open(ours, "rb") as handle:  # ours held too: its one holder, not the other file's
                fcntl.flock(handle, fcntl.LOCK_EX)
                assert [pid for pid, _ in lock_holders(str(ours))] == [os.getpid()]
        finally:
            holder.kill()
            holder.wait()
    finally:
        for p in points:
            subprocess.run(["umount", str(p)], capture_output=True)
