"""A verified layer is mapped at the data offset its manifest records, without its header.

The manifest records each layer file's data offset and the stamp (device, inode, size,
mtime, ctime) the file had when its bytes last matched their checksum. A start maps a
file that still has that stamp at that offset; what a start reads is asked of Python's
audit hook ("open" events) in a fresh interpreter: a header is read through
``/proc/self/fd/N``, the very file the mapping's descriptor is open on. A file that
changed (another header, its data elsewhere) is never mapped at the recorded offset: it
is verified as any changed file is, and rebuilt. A manifest without offsets (an older
release's) is still served, its headers read.
"""

from __future__ import annotations

import json
import os

import torch

from hostmem.safetensors.mapping import read_header, save_file
from hostmem.vault import Vault
from hostmem.vault.content_hash import stamp_of
from hostmem.vault.layer_file import LAYER_FORMAT, layer_file_name
from hostmem.vault.manifest import MANIFEST_NAME
from tests.conftest import run_python
from tests.fresh_fork import TORCH
from tests.hostmem.vault.test_vault import CHILD_START, SHAPE, build, expected_of, folder_of, key_for, layers

_START = CHILD_START + r"""
if built:
    print(json.dumps({"built": True}))
    sys.exit(0)
headers_read = []
phase = None

def hook(event, args):
    if event == "open" and phase == "get" and str(args[0]).startswith("/proc/self/fd/"):
        headers_read.append(str(args[0]))

sys.addaudithook(hook)
session = vault.open(key, expected)
phase = "get"
views = {n: session.get(n, s, d) for n, (s, d) in expected.items()}
phase = None
session.close()
assert all(v is not None and torch.equal(v, tensors[n]) for n, v in views.items()), session.stats
print(json.dumps({"headers_read": len(headers_read), "hit": session.stats["layers_hit"]}))
"""


def _start(root, count: int = 6) -> dict:
    done = run_python(_START, str(root), str(count), "layout", forked_from=TORCH)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _manifest_path(root) -> str:
    cache = os.path.join(root, "lora_merge_cache")
    (key,) = [n for n in os.listdir(cache) if os.path.isdir(os.path.join(cache, n))]
    return os.path.join(cache, key, MANIFEST_NAME)


def _as_an_older_release_wrote_it(path: str) -> None:
    """Strip what this release adds to each layer's record: offsets, stamps, their digest."""
    with open(path) as handle:
        data = json.load(handle)
    data.pop("layers_sha256")
    for layer in data["layers"]:
        del layer["data_offset"], layer["stamp"]
    with open(path, "w") as handle:
        json.dump(data, handle)


def _rewrite_with_another_header(folder: str, name: str, tensor: torch.Tensor) -> int:
    """Replace ``name``'s layer file by one with the same tensor under a longer header (its
    data further on), through a new file renamed over it; return the new data offset."""
    path = os.path.join(folder, layer_file_name(name))
    crc = read_header(path).metadata["crc32"]
    tmp = path + ".new"
    save_file({name: tensor}, tmp, metadata={"format": LAYER_FORMAT, "crc32": crc, "note": "x" * 5000})
    os.replace(tmp, path)
    return read_header(path).data_offset


def test_the_seal_records_each_layers_data_offset_and_stamp(tmp_path):
    vault, key, tensors = Vault(tmp_path / "root"), key_for("layout"), layers()
    build(vault, key, tensors)
    folder = folder_of(vault, key)
    with open(os.path.join(folder, MANIFEST_NAME)) as handle:
        records = json.load(handle)["layers"]
    assert len(records) == len(tensors)
    for record in records:
        path = os.path.join(folder, record["file"])
        assert record["data_offset"] == read_header(path).data_offset
        assert record["stamp"] == stamp_of(os.lstat(path))


def test_a_start_maps_every_verified_layer_without_reading_its_header(tmp_path):
    assert _start(tmp_path / "root") == {"built": True}
    assert _start(tmp_path / "root") == {"headers_read": 0, "hit": 6}


def test_a_manifest_of_an_older_release_is_served_by_reading_its_headers(tmp_path):
    _start(tmp_path / "root")
    _as_an_older_release_wrote_it(_manifest_path(tmp_path / "root"))
    assert _start(tmp_path / "root") == {"headers_read": 6, "hit": 6}


def test_a_layer_file_rewritten_with_another_header_is_verified_and_rebuilt(tmp_path, capfd):
    """Its data now starts elsewhere: mapped at the recorded offset it would be wrong bytes."""
    vault, key, tensors = Vault(tmp_path / "root"), key_for("rewritten"), layers(torch.float32)
    build(vault, key, tensors)
    name = next(iter(tensors))
    folder = folder_of(vault, key)
    with open(os.path.join(folder, MANIFEST_NAME)) as handle:
        recorded = {r["name"]: r["data_offset"] for r in json.load(handle)["layers"]}
    assert _rewrite_with_another_header(folder, name, tensors[name]) != recorded[name]
    with vault.open(key, expected_of(tensors)) as session:
        assert session.stats["layers_failed_check"] == [name]
        assert session.get(name, SHAPE, torch.float32) is None  # not served: rebuilt below
        assert session.put(name, tensors[name]) is not None
        others = [n for n in tensors if n != name]
        assert all(torch.equal(session.get(n, SHAPE, torch.float32), tensors[n]) for n in others)
    assert f"layer {name!r} failed its check" in capfd.readouterr().err
    with vault.open(key, expected_of(tensors)) as session:
        assert torch.equal(session.get(name, SHAPE, torch.float32), tensors[name])
        assert session.stats["layers_failed_check"] == []


def test_a_layer_file_rewritten_after_open_is_not_mapped_at_the_recorded_offset(tmp_path):
    """Verified at open, changed before get: its stamp no longer matches, so its header is
    read, found changed, and the combination dropped rather than served."""
    vault, key, tensors = Vault(tmp_path / "root"), key_for("late"), layers(torch.float32)
    build(vault, key, tensors)
    name = next(iter(tensors))
    with vault.open(key, expected_of(tensors)) as session:
        _rewrite_with_another_header(folder_of(vault, key), name, tensors[name])
        assert session.get(name, SHAPE, torch.float32) is None
        assert "header changed" in session.stats["dropped"]


def test_a_recorded_offset_that_does_not_fit_its_layer_drops_the_combination(tmp_path):
    vault, key, tensors = Vault(tmp_path / "root"), key_for("offset"), layers()
    build(vault, key, tensors)
    path = os.path.join(folder_of(vault, key), MANIFEST_NAME)
    with open(path) as handle:
        data = json.load(handle)
    data["layers"][0]["data_offset"] += 4096
    with open(path, "w") as handle:
        json.dump(data, handle)
    with vault.open(key, expected_of(tensors)) as session:
        assert "data offset" in session.stats["dropped"] and data["layers"][0]["name"] in session.stats["dropped"]
        assert not session.layers


def test_a_write_behind_the_verifying_read_is_never_vouched_for(tmp_path, monkeypatch):
    """A layer re-read for its checksum (its stamp changed) while a writer changes bytes the
    read has passed: the read finds the checksum right, but what is on disk after it is not
    what was read. Vouched for, every later start would serve it unread: it fails its check
    and is rebuilt, and the next start reads it again."""
    from hostmem.vault import verification

    vault, key, tensors = Vault(tmp_path / "root"), key_for("behind"), layers(torch.float32)
    build(vault, key, tensors)
    name = next(iter(tensors))
    folder = folder_of(vault, key)
    path = os.path.join(folder, layer_file_name(name))
    os.utime(path)  # a new stamp, the same bytes: the next start reads it
    problem = verification._problem

    def read_then_written(where, entry):
        found = problem(where, entry)  # the whole read, the bytes as they were
        if entry.name == name:
            with open(os.path.join(where, entry.file), "r+b") as handle:  # behind the read: the last byte
                handle.seek(-1, os.SEEK_END)
                last = handle.read(1)
                handle.seek(-1, os.SEEK_END)
                handle.write(bytes([last[0] ^ 0xFF]))
        return found

    monkeypatch.setattr(verification, "_problem", read_then_written)
    with vault.open(key, expected_of(tensors)) as session:
        assert session.stats["layers_failed_check"] == [name]
        assert session.get(name, SHAPE, torch.float32) is None
        assert session.put(name, tensors[name]) is not None
    monkeypatch.setattr(verification, "_problem", problem)
    with vault.open(key, expected_of(tensors)) as session:
        assert session.stats["layers_failed_check"] == []
        assert torch.equal(session.get(name, SHAPE, torch.float32), tensors[name])


def test_a_layer_whose_bytes_change_after_open_is_read_before_it_is_served(tmp_path):
    """Verified at open, one byte of its data changed before get (same size, same header):
    its stamp no longer matches, so its bytes are checksummed again, and it is not served."""
    vault, key, tensors = Vault(tmp_path / "root"), key_for("late-bytes"), layers(torch.float32)
    build(vault, key, tensors)
    name = next(iter(tensors))
    path = os.path.join(folder_of(vault, key), layer_file_name(name))
    with vault.open(key, expected_of(tensors)) as session:
        with open(path, "r+b") as handle:
            handle.seek(-1, os.SEEK_END)
            last = handle.read(1)
            handle.seek(-1, os.SEEK_END)
            handle.write(bytes([last[0] ^ 0xFF]))
        assert session.get(name, SHAPE, torch.float32) is None
        assert "content changed since it was verified" in (session.stats["dropped"] or "")
