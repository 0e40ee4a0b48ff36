"""A folder on the way swapped for a link: nothing outside the root is read, written or removed.

Every path of the cache is walked from its root's descriptor, one folder at a time
without following a link (:mod:`hostmem.vault.anchor`). Here a key folder is swapped
for a link to a combination outside the root: before a start, and over and over while
starts, ``verify``, ``prune`` and ``rm`` run (``renameat2(RENAME_EXCHANGE)``: both
names exist at every instant, so only a check made by one name and an open made by the
same name again can tell them apart). The combination outside holds the same key with
other weights, valid checksums and a manifest of its own, owned by this user in the race
(so no owner check saves the day, only the walk) and by ``nobody`` before a start.
Nothing outside may be served, read (every atime there is set before the mtime, so any
read or mapping, a folder's listing included, moves it: the kernel's ``relatime``),
written or removed.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import time

import pytest
import torch

from hostmem.vault import Vault, VaultError
from hostmem.vault.admin import prune, remove, verify_all
from tests.hostmem.vault.test_vault import build, expected_of, key_for, layers

from .users import nobody, snapshot

_RENAME_EXCHANGE = 2  # <linux/fs.h>
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> None:
    """Swap two names atomically (``renameat2`` with ``RENAME_EXCHANGE``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(_AT_FDCWD, a.encode(), _AT_FDCWD, b.encode(), _RENAME_EXCHANGE) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), a)


def _can_exchange(tmp_path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    os.symlink("a", b)
    try:
        _exchange(str(a), str(b))
    except (OSError, AttributeError) as exc:
        pytest.skip(f"renameat2(RENAME_EXCHANGE) not available here: {exc}")
    finally:
        os.unlink(a)
        os.rmdir(b)


def _age_reads(folder) -> list[str]:
    """Set every atime under ``folder`` before its mtime (the next read moves it); return
    the paths, so that checking them lists no folder."""
    paths = [os.path.join(here, name) for here, dirs, files in os.walk(folder) for name in [*dirs, *files, ""]]
    for path in paths:
        os.utime(path, ns=(1, os.lstat(path).st_mtime_ns), follow_symlinks=False)
    return paths


def _read(paths: list[str]) -> list[str]:
    """Which of ``paths`` were read (or listed, or mapped) since :func:`_age_reads`."""
    return [p for p in paths if os.lstat(p).st_atime_ns != 1]


def _world(tmp_path, count: int = 16):
    """A root with a combination, the same key built outside with other weights, and a
    link to it beside the real folder, ready to be swapped in."""
    _can_exchange(tmp_path)
    key, good, evil = key_for("anchored"), layers(count=count, seed=1), layers(count=count, seed=2)
    vault = Vault(str(tmp_path / "root"))
    build(vault, key, good)
    outside = tmp_path / "outside"
    build(Vault(str(outside)), key, evil)
    real = os.path.join(vault.cache, key.hex)
    link = os.path.join(vault.cache, ".swap")
    os.symlink(os.path.join(outside, "lora_merge_cache", key.hex), link)
    return vault, key, good, evil, real, link, outside


def _serve(vault: Vault, key, good: dict, evil: dict) -> int:
    """One start's worth of gets; how many layers were served. Never a weight of ``evil``."""
    served = 0
    try:
        session = Vault(vault.root).open(key, expected_of(good))
    except VaultError:
        return 0  # refused, naming the link
    try:
        for name, tensor in good.items():
            try:
                view = session.get(name, tuple(tensor.shape), tensor.dtype)
            except VaultError:
                break
            if view is not None:
                assert not torch.equal(view, evil[name]), f"{name}: served the weights outside the root"
                assert torch.equal(view, tensor)
                served += 1
    finally:
        try:
            session.close()
        except VaultError:  # its seal refused: the folder's name was a link at that instant
            pass
    return served


def _swap_until(real: str, link: str, seconds: float) -> None:
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        _exchange(real, link)


def test_a_key_folder_swapped_for_a_link_before_a_start_reaches_nothing_outside(tmp_path):
    uid, gid = nobody()
    vault, key, good, evil, real, link, outside = _world(tmp_path)
    for here, dirs, files in os.walk(outside):
        for name in [*dirs, *files, ""]:
            os.lchown(os.path.join(here, name), uid, gid)  # another user's, as it would be
    _exchange(real, link)  # the key's name is now a link to the other combination
    around = snapshot(tmp_path, [vault.root])  # reads every file: before the atimes are set
    aged = _age_reads(outside)
    assert _serve(vault, key, good, evil) == 0
    reports = verify_all(vault.cache)
    assert any(key.hex in " ".join(r.problems + r.notes) or r.key == key.hex for r in reports)
    prune(vault.cache, everything=True)
    with pytest.raises((VaultError, OSError)):
        remove(vault.cache, key.hex[:12])
    assert _read(aged) == []
    assert snapshot(tmp_path, [vault.root]) == around


def test_a_key_folder_swapped_back_and_forth_during_starts_is_never_followed(tmp_path):
    vault, key, good, evil, real, link, outside = _world(tmp_path)
    around = snapshot(outside)
    aged = _age_reads(outside)
    swapper = multiprocessing.get_context("fork").Process(target=_swap_until, args=(real, link, 3.0))
    swapper.start()
    served = starts = 0
    try:
        while swapper.is_alive():
            served += _serve(vault, key, good, evil)
            starts += 1
            verify_all(vault.cache)
    finally:
        swapper.join()
    assert swapper.exitcode == 0
    assert starts >= 3
    if os.path.islink(real):
        _exchange(real, link)
    prune(vault.cache, everything=True)  # removes what is in the root, through no link
    assert _read(aged) == []
    assert snapshot(outside) == around


def test_a_folder_swapped_between_its_check_and_the_open_below_it_is_refused_not_followed(tmp_path):
    """The gap itself, without timing luck: the key folder checked by its path, swapped
    for a link, then a manifest, a memo, a layer and a lock opened below it."""
    from hostmem.vault.locks import lock_is_held
    from hostmem.vault.manifest import MANIFEST_NAME
    from hostmem.vault.safety import check_folder_safe, open_trusted, read_trusted
    from hostmem.vault.verification import VERIFIED_NAME

    vault, key, good, evil, real, link, outside = _world(tmp_path, count=2)
    check_folder_safe(real)  # what a reader checked by the path...
    _exchange(real, link)  # ...before the name became a link
    around = snapshot(outside)
    aged = _age_reads(outside)
    layer = next(n for n in os.listdir(link) if n.endswith(".safetensors"))
    for name in (MANIFEST_NAME, VERIFIED_NAME, layer):
        with pytest.raises(VaultError, match=r"is a symlink"):
            read_trusted(os.path.join(real, name))
    with pytest.raises(VaultError, match=r"is a symlink"):
        open_trusted(os.path.join(real, "planted.lock"), os.O_RDWR | os.O_CREAT)
    with pytest.raises(OSError):
        lock_is_held(os.path.join(real, "planted.lock"), shared_too=True)
    assert _read(aged) == []
    assert snapshot(outside) == around


def test_a_key_folder_swapped_for_a_link_during_a_build_gets_no_layer_outside(tmp_path):
    """A build opens its key folder from the root's descriptor once a session and writes,
    seals and maps every layer in that descriptor (512 small layers walked the path 5-6
    times each). Swapped for a link between two layers, the folder it checked takes the
    layers after the swap too, bit for bit; nothing outside is written; the seal, which
    walks the names again, is refused or names the folder it checked."""
    _can_exchange(tmp_path)
    key, good, evil = key_for("mid-build"), layers(count=4, seed=1), layers(count=4, seed=2)
    vault = Vault(str(tmp_path / "root"))
    outside = tmp_path / "outside"
    build(Vault(str(outside)), key, evil)
    real, link = os.path.join(vault.cache, key.hex), os.path.join(vault.cache, ".swap")
    names = list(good)
    session = vault.open(key, expected_of(good))
    try:
        assert session.put(names[0], good[names[0]]) is not None, session.last_error
        os.symlink(os.path.join(outside, "lora_merge_cache", key.hex), link)
        around = snapshot(outside)
        _exchange(real, link)  # the key's name is now the link; the folder being built is ".swap"
        for name in names[1:]:
            view = session.put(name, good[name])
            assert view is not None, session.last_error
            assert torch.equal(view, good[name])
    finally:
        try:
            session.close()
        except VaultError:  # the seal walked the key's name and met the link
            pass
    assert snapshot(outside) == around
    built = [n for n in os.listdir(link) if n.endswith(".safetensors") and not n.startswith(".tmp-")]
    assert len(built) == len(names)  # every layer, before and after the swap, in the folder checked
