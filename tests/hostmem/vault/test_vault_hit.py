"""The all-hit session: a sealed, complete, vouched-for combination is served as it was sealed.

Opening it reads no layer header (mapping reads each one, once) and closing it rewrites
no file; what a layer file was opened for is asked of Python's audit hook ("open"
events, os.open included; a name without a folder is one opened relative to a folder's
descriptor) in a fresh interpreter. A manifest that no longer matches its
files is still never served.
"""

from __future__ import annotations

import json
import os

import torch

from hostmem.vault import Vault
from hostmem.vault.combinations import list_combinations
from hostmem.vault.manifest import MANIFEST_NAME
from tests.conftest import run_python
from tests.fresh_fork import TORCH
from tests.hostmem.vault.test_vault import CHILD_START, SHAPE, build, expected_of, folder_of, key_for, layers

_SESSION = CHILD_START + r"""
touch = sys.argv[4] == "touch"
folder = os.path.join(vault.cache, key.hex)
if touch:  # a layer file written to (same bytes): its memo no longer vouches for it
    first = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))[0]
    with open(os.path.join(folder, first), "r+b") as handle:
        first_byte = handle.read(1)
        handle.seek(0)
        handle.write(first_byte)
seen = {"open": [], "get": [], "close": []}
phase = None

def hook(event, args):
    # the vault opens a folder's files by name relative to the folder's descriptor (openat)
    named = str(args[0]) if event == "open" else ""
    if phase is not None and (named.startswith(folder + os.sep)
                              or named and not os.path.isabs(named)
                              and (os.path.lexists(os.path.join(folder, named)) or named.startswith(".tmp-"))):
        writing = isinstance(args[2], int) and args[2] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        seen[phase].append((os.path.basename(str(args[0])), bool(writing or "w" in str(args[1] or ""))))

sys.addaudithook(hook)
phase = "open"
session = vault.open(key, expected)
phase = "get"
views = [session.get(n, s, d) for n, (s, d) in expected.items()]
phase = "close"
session.close()
phase = None
assert all(v is not None and torch.equal(v, tensors[n]) for v, n in zip(views, expected))
print(json.dumps({p: [[f, w] for f, w in opened] for p, opened in seen.items()}))
"""


def _session(root, count: int = 8, touch: bool = False) -> dict:
    done = run_python(_SESSION, str(root), str(count), "hit", "touch" if touch else "", forked_from=TORCH)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _layer_files(opened) -> list[str]:
    return [f for f, _ in opened if f.endswith(".safetensors")]


def test_an_all_hit_session_reads_each_header_once_and_writes_nothing(tmp_path):
    _session(tmp_path / "root")  # built and sealed by one process
    seen = _session(tmp_path / "root")  # served by the next
    assert _layer_files(seen["open"]) == []  # no header read at open
    assert len(_layer_files(seen["get"])) == 8 == len(set(_layer_files(seen["get"])))  # one open per layer
    assert not [f for f, writing in seen["open"] + seen["get"] + seen["close"] if writing]


def test_a_layer_file_changed_since_its_seal_is_checked_again_at_open(tmp_path):
    """The probe can see header reads and writes: the slow path has them."""
    _session(tmp_path / "root")
    seen = _session(tmp_path / "root", touch=True)
    assert _layer_files(seen["open"])  # the changed file is read again (header, then its checksum)
    assert [f for f, writing in seen["close"] if writing]  # the seal records the new verification


def test_an_all_hit_session_keeps_the_manifest_and_still_counts_as_a_use(tmp_path):
    vault = Vault(tmp_path / "root")
    first, second = key_for("first"), key_for("second")
    tensors = layers()
    build(vault, first, tensors)
    build(vault, second, tensors)
    manifest = os.path.join(folder_of(vault, first), MANIFEST_NAME)
    before = os.stat(manifest)
    with open(manifest, "rb") as handle:
        sealed = handle.read()
    with vault.open(first, expected_of(tensors)) as session:
        assert session.complete and session.get("blocks.0.attn.qkv.weight", SHAPE, torch.bfloat16) is not None
    after = os.stat(manifest)
    with open(manifest, "rb") as handle:
        assert handle.read() == sealed and after.st_ino == before.st_ino  # not rewritten
    assert [c.key for c in list_combinations(vault.cache)] == [second.hex, first.hex]  # first: used last


def test_a_manifest_that_no_longer_matches_its_layer_file_is_not_served(tmp_path, capfd):
    """The memo vouches for the file, but the manifest records another header: mapping
    compares them, and the combination is dropped rather than served."""
    vault, key, tensors = Vault(tmp_path / "root"), key_for("edited"), layers()
    build(vault, key, tensors)
    path = os.path.join(folder_of(vault, key), MANIFEST_NAME)
    with open(path) as handle:
        data = json.load(handle)
    data["layers"][0]["header_sha256"] = "0" * 64
    with open(path, "w") as handle:
        json.dump(data, handle)
    with vault.open(key, expected_of(tensors)) as session:
        name = data["layers"][0]["name"]
        assert session.get(name, tuple(tensors[name].shape), tensors[name].dtype) is None
        assert not session.layers and not session.complete
    assert "size or header changed since it was sealed" in capfd.readouterr().err
