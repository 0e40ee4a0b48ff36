"""The whole path to a cache root is trusted or refused, and the root checked is the one used.

Each attack is the other user's (``nobody``) for real: a link or a folder of theirs above
the root, a shared ``$HOME`` whose ``.cache`` they link, a root swapped after the check.
Each ends in one clear refusal that names the folder, its owner and mode and what to
run, or in a start on the right folder: nothing is created, written or removed outside
the root, and nothing raises anything but :class:`VaultError`.
"""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from hostmem.vault import Vault, VaultError
from hostmem.vault.admin import existing_cache_dir
from hostmem.vault.roots import cache_roots
from hostmem.vault.safety import make_private_dir, prepare_root
from tests.hostmem.vault.test_vault import build, key_for, layers

from .test_anchored import _can_exchange, _exchange
from .users import as_nobody, nobody, reachable_by_others, shared_folder, snapshot


def _victim(tmp_path) -> str:
    """A folder of this user's the other user would like the cache to land in."""
    victim = str(tmp_path / "victim")
    os.mkdir(victim, 0o700)
    with open(os.path.join(victim, "keep.txt"), "w") as handle:
        handle.write("mine")
    return victim


def test_a_link_another_user_made_above_the_root_in_a_sticky_folder_is_refused(tmp_path):
    uid = nobody()[0]
    shared, victim = shared_folder(tmp_path), _victim(tmp_path)
    with reachable_by_others(shared):
        as_nobody(os.symlink, victim, os.path.join(shared, "team"))
    around = snapshot(tmp_path)
    with pytest.raises(VaultError, match=rf"shared/team: a link made by uid {uid} \(on the way to the cache root") as refused:
        Vault(os.path.join(shared, "team", "hostmem"))
    assert f"(`rm {os.path.join(shared, 'team')}`" in str(refused.value)  # the path to remove, spelt out
    assert snapshot(tmp_path) == around


def _theirs(shared: str, name: str, mode: int) -> str:
    folder = os.path.join(shared, name)
    os.mkdir(folder, mode)
    os.chmod(folder, mode)
    return folder


def test_a_folder_another_user_owns_or_anyone_may_write_above_the_root_is_refused_with_the_command(tmp_path):
    uid = nobody()[0]
    shared = shared_folder(tmp_path)
    with reachable_by_others(shared):
        as_nobody(_theirs, shared, "open", 0o777)  # 0777, theirs: they may swap anything in it later
    mine_open = _theirs(str(tmp_path), "everyone", 0o777)
    around = snapshot(tmp_path)
    with pytest.raises(VaultError) as refused:
        Vault(os.path.join(shared, "open", "hostmem"))
    said = str(refused.value)
    assert f"shared/open: a folder on the way to the cache root" in said and f"owned by uid {uid}" in said
    assert "mode 0777" in said and "sudo chown root:root" in said and "chmod go-w" in said
    assert "chmod +t" not in said  # a sticky bit leaves their own folder theirs: no advice that cannot help
    with pytest.raises(VaultError, match=r"everyone: a folder on the way .* writable by every user \(mode 0777") as mine:
        Vault(os.path.join(mine_open, "hostmem"))
    assert "chmod +t" in str(mine.value)  # a folder of a trusted owner that others must share
    assert snapshot(tmp_path) == around


def test_a_shared_home_whose_cache_another_user_linked_is_refused_and_xdg_cache_home_is_used(tmp_path, monkeypatch):
    uid = nobody()[0]
    home, victim = shared_folder(tmp_path), _victim(tmp_path)  # a service's HOME in a shared folder
    with reachable_by_others(home):
        as_nobody(os.symlink, victim, os.path.join(home, ".cache"))
    monkeypatch.delenv("HOSTMEM_CACHE_ROOT", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", home)
    around = snapshot(tmp_path)
    (root,) = cache_roots(None)
    assert root == os.path.join(home, ".cache", "hostmem")
    with pytest.raises(VaultError, match=rf"\.cache: a link made by uid {uid}"):
        Vault(root)
    assert snapshot(tmp_path) == around
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    (root,) = cache_roots(None)
    assert root == str(tmp_path / "xdg" / "hostmem")
    build(Vault(root), key_for("xdg"), layers(count=1))
    assert snapshot(tmp_path, [str(tmp_path / "xdg")]) == around


def test_a_root_swapped_after_its_check_is_never_entered(tmp_path):
    """Even a swap the path rule allows (a link of this user's) is caught by the identity
    the check kept: the vault checked one folder and meets another."""
    victim, parent = _victim(tmp_path), tmp_path / "mine"
    parent.mkdir(mode=0o700)
    root = str(parent / "root")
    vault = Vault(root)
    key, tensors = key_for("swapped"), layers(count=2)
    os.rename(root, root + ".old")
    os.symlink(victim, root)
    around = snapshot(victim)
    with pytest.raises(VaultError, match=r"root: is no longer the folder checked when the cache opened it"):
        build(vault, key, tensors)
    assert snapshot(victim) == around


def _swap_forever(folder: str, link: str, seconds: float) -> None:
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        _exchange(folder, link)


def test_a_root_in_another_users_folder_swapped_during_starts_and_cache_commands_is_refused_cleanly(tmp_path):
    """The other user swaps the root with a link to this user's folder, over and over
    (``renameat2(RENAME_EXCHANGE)``): every start and every ``cache`` command is refused
    with one line, nothing else raises, and nothing lands in or leaves the victim."""
    uid, gid = nobody()
    _can_exchange(tmp_path)
    victim = _victim(tmp_path)
    theirs = str(tmp_path / "theirs")
    os.mkdir(theirs, 0o755)
    root = os.path.join(theirs, "root")
    os.mkdir(root, 0o700)  # the root made by this user, in a folder of theirs
    os.symlink(victim, os.path.join(theirs, "swap"))
    os.lchown(os.path.join(theirs, "swap"), uid, gid)
    os.chown(theirs, uid, gid)
    around = snapshot(victim)
    with reachable_by_others(theirs):
        swapper = multiprocessing.get_context("fork").Process(
            target=as_nobody, args=(_swap_forever, root, os.path.join(theirs, "swap"), 1.5))
        swapper.start()
        tries = 0
        try:
            while swapper.is_alive() or tries < 3:
                tries += 1
                for attempt in (lambda: Vault(root), lambda: make_private_dir(os.path.join(root, "x")),
                                lambda: prepare_root(root)):
                    with pytest.raises(VaultError, match=rf"theirs: a folder on the way .* owned by uid {uid}"):
                        attempt()
                try:  # `hostmem cache ls/verify/prune`: a root without a cache folder lists nothing
                    assert existing_cache_dir(root) is None
                except VaultError as refused:
                    assert f"owned by uid {uid}" in str(refused)
        finally:
            swapper.join()
    assert swapper.exitcode == 0
    assert snapshot(victim) == around


def _open_fresh(root: str, barrier) -> None:
    barrier.wait()
    Vault(root)


def test_starts_making_the_same_new_root_at_once_all_open_it(tmp_path):
    """Ranks starting together on a root not made yet: the folders one makes while another
    walks are walked and checked as found, not refused."""
    context = multiprocessing.get_context("fork")
    for attempt in range(3):
        root = str(tmp_path / str(attempt) / "a" / "b" / "c" / "d" / "root")
        barrier = context.Barrier(6)
        starts = [context.Process(target=_open_fresh, args=(root, barrier)) for _ in range(6)]
        for process in starts:
            process.start()
        for process in starts:
            process.join(60)
        assert [p.exitcode for p in starts] == [0] * 6
    assert oct(os.stat(root).st_mode & 0o777) == "0o700"
    assert oct(os.stat(os.path.dirname(root)).st_mode & 0o777) == "0o755"
