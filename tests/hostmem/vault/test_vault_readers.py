"""Readers: a sealed, verified combination opens with its key's lock held shared, so several
processes map it at once; a writer still waits for them, and a combination with anything
to verify or repair opens the plain, exclusive way. Other processes are real interpreters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import torch

from hostmem.vault import Vault
from hostmem.vault.combinations import lock_path
from hostmem.vault.locks import lock_is_held
from hostmem.vault.readers import SealedSession
from tests.conftest import run_python
from tests.fresh_fork import TORCH
from tests.hostmem.vault.test_vault import build, expected_of, folder_of, key_for, layers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
_OPEN = """
import json, sys
import torch
from hostmem.vault import Vault
from tests.hostmem.vault.test_vault import expected_of, key_for, layers

tensors = layers(count=4)
expected = {n: (s, d) for n, (s, d) in expected_of(tensors).items()}
if sys.argv[2] == "other-dtype":
    expected = {n: (s, torch.float32) for n, (s, _) in expected.items()}
with Vault(sys.argv[1]).open(key_for("readers"), expected) as session:
    views = {n: session.get(n, s, d) for n, (s, d) in expected.items()}
    print(json.dumps({"kind": type(session).__name__, "verified": session.stats["layers_verified"],
                      "equal": all(v is not None and torch.equal(v, tensors[n]) for n, v in views.items())}))
"""


def _built(tmp_path):
    vault, key, tensors = Vault(tmp_path / "root"), key_for("readers"), layers(count=4)
    build(vault, key, tensors)
    return vault, key, tensors


def _other_process(root, how: str = "same", timeout: float = 60) -> dict:
    done = run_python(_OPEN, str(root), how, timeout=timeout, cwd=REPO, forked_from=TORCH)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_another_process_maps_a_sealed_combination_while_this_one_holds_it(tmp_path):
    vault, key, tensors = _built(tmp_path)
    with vault.open(key, expected_of(tensors)) as session:
        assert isinstance(session, SealedSession) and not session.writable
        assert lock_is_held(lock_path(vault.cache, key.hex), shared_too=True)  # writers are kept out
        assert not lock_is_held(lock_path(vault.cache, key.hex), shared_too=False)  # readers are not
        other = _other_process(tmp_path / "root", timeout=30)  # before: waited for this session, forever
        assert other == {"kind": "SealedSession", "verified": 0, "equal": True}
        assert all(torch.equal(session.get(n, t.shape, t.dtype), t) for n, t in tensors.items())
        assert session.put("blocks.9.attn.qkv.weight", tensors["blocks.0.attn.qkv.weight"]) is None
    assert os.path.exists(os.path.join(folder_of(vault, key), "manifest.json"))


def test_a_writer_waits_for_the_readers_and_goes_on_once_they_close(tmp_path):
    vault, key, tensors = _built(tmp_path)
    session = vault.open(key, expected_of(tensors))
    code = textwrap.dedent(_OPEN)
    writer = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "root"), "other-dtype"], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        waiting = writer.stderr.readline()  # another dtype: it drops the combination, so it must wait
        assert "is in use by another process" in waiting, waiting
        assert writer.poll() is None
    finally:
        session.close()
    out, err = writer.communicate(timeout=60)
    assert writer.returncode == 0, err
    assert '"kind": "VaultSession"' in out


def test_a_layer_changed_since_its_seal_opens_exclusively_is_verified_and_then_read_shared(tmp_path):
    vault, key, tensors = _built(tmp_path)
    folder = folder_of(vault, key)
    first = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))[0]
    with open(os.path.join(folder, first), "r+b") as handle:  # the same bytes, written: its stamp changes
        byte = handle.read(1)
        handle.seek(0)
        handle.write(byte)
    assert _other_process(tmp_path / "root") == {"kind": "VaultSession", "verified": 1, "equal": True}
    assert _other_process(tmp_path / "root") == {"kind": "SealedSession", "verified": 0, "equal": True}


_HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _held_exclusively(path: str, seconds: float) -> subprocess.Popen:
    """Another process holding the lock file ``path`` exclusively for ``seconds``, then exiting."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, path, str(seconds)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_reader_arriving_as_another_leaves_still_maps_shared(tmp_path):
    """A reader leaving removes the lock file under the lock held exclusively for an instant:
    one arriving then asks again for a moment instead of opening the plain way (where it
    waited and adopted), and one that finds a writer holding on lets go and answers None."""
    from hostmem.vault.readers import DEPARTING_READER_S, open_sealed

    vault, key, tensors = _built(tmp_path)
    path = lock_path(vault.cache, key.hex)
    holder = _held_exclusively(path, DEPARTING_READER_S / 10)
    try:
        session = open_sealed(vault, key.hex, {}, expected_of(tensors))
        assert isinstance(session, SealedSession)
        session.close()
    finally:
        holder.wait(timeout=30)
    writer = _held_exclusively(path, 30)
    try:
        started = time.monotonic()
        assert open_sealed(vault, key.hex, {}, expected_of(tensors)) is None
        assert DEPARTING_READER_S <= time.monotonic() - started < 10
    finally:
        writer.kill()
        writer.wait(timeout=30)


def test_a_manifest_edited_by_hand_is_not_served_and_the_next_start_rebuilds_it(tmp_path, capfd):
    """Two layers' names swapped in the manifest: each record now names a file the cache
    would not give that layer, so the manifest is damaged as it is read, on the shared
    path as on the plain one: nothing of it is served, the plain open drops and rebuilds
    it, and the start after maps shared again."""
    vault, key, tensors = _built(tmp_path)
    folder = folder_of(vault, key)
    manifest_path = os.path.join(folder, "manifest.json")
    with open(manifest_path) as handle:
        manifest = json.load(handle)
    first, second = manifest["layers"][0], manifest["layers"][1]
    first["name"], second["name"] = second["name"], first["name"]
    with open(manifest_path, "w") as handle:
        json.dump(manifest, handle)
    expected = expected_of(tensors)
    with vault.open(key, expected) as session:
        assert not isinstance(session, SealedSession)
        assert session.stats["dropped"] and "is not the name the cache gives it" in session.stats["dropped"]
        assert all(session.get(n, s, d) is None for n, (s, d) in expected.items())
        for name, tensor in tensors.items():
            session.put(name, tensor)
    assert "dropped the whole combination" in capfd.readouterr().err
    assert _other_process(tmp_path / "root") == {"kind": "SealedSession", "verified": 0, "equal": True}


_OUT_OF_DESCRIPTORS = """
import json, os, resource, sys
from hostmem.vault import Vault
from tests.hostmem.vault.test_vault import expected_of, key_for, layers

expected = expected_of(layers(count=4))
with Vault(sys.argv[1]).open(key_for("readers"), expected) as session:
    kind = type(session).__name__
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    served = [session.get(n, s, d) is not None for n, (s, d) in expected.items()]
    for fd in held:
        os.close(fd)
print(json.dumps({"kind": kind, "served": served}))
"""


def test_a_reader_out_of_file_descriptors_serves_nothing_and_records_no_damage(tmp_path):
    """EMFILE is the process's trouble, not the file's: recorded as damage, it would send the
    next start to read every layer again, and ``prune`` would remove a good combination."""
    from hostmem.vault.verification import read_damage

    vault, key, _ = _built(tmp_path)
    done = run_python(_OUT_OF_DESCRIPTORS, str(tmp_path / "root"), cwd=REPO)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"kind": "SealedSession", "served": [False] * 4}, found
    assert "Too many open files" in done.stderr and "nothing is wrong with its files" in done.stderr, done.stderr
    assert read_damage(folder_of(vault, key)) is None
    assert _other_process(tmp_path / "root") == {"kind": "SealedSession", "verified": 0, "equal": True}
