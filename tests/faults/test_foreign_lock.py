"""A key's lock held by another user, or held too long: named, never waited on for ever.

Held by another user, the start serves the sealed combination from the cache without
the lock (never in place: no process of this user's can change it meanwhile); held by a
process of this user's past ``HOSTMEM_LOCK_TIMEOUT``, the start merges in place.

The holder is a real process (forked, for the foreign case with ``nobody``'s uid for
real) holding a real flock on the key's lock file. The start runs in a child of its own,
so a start that waited forever would fail the test rather than hang the run.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time

import pytest

from tests.faults.world import combination_folder, make_world, start
from tests.security.test_names import start_elsewhere
from tests.security.users import nobody, snapshot


def _hold(path: str, uid: int | None) -> int:
    """Fork a process that holds an exclusive flock on ``path`` (as ``uid`` where given)
    until it is killed; its pid, once it holds the lock."""
    ready_r, ready_w = os.pipe()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ready_r)
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(ready_w, b"held")
            while True:
                time.sleep(60)
        finally:
            os._exit(0)
    os.close(fd)
    os.close(ready_w)
    assert os.read(ready_r, 4) == b"held"
    os.close(ready_r)
    return pid


def _let_go(pid: int) -> None:
    os.kill(pid, 9)
    os.waitpid(pid, 0)


@pytest.mark.parametrize("holder", ["another user", "this user, past the timeout"])
def test_a_held_lock_is_named_and_the_start_serves_or_merges_in_place(tmp_path, holder, monkeypatch):
    uid = nobody()[0] if holder == "another user" else None
    world = make_world(tmp_path / "world")
    root = str(tmp_path / "root")
    start(world.base, world.adapter, root)
    folder = combination_folder(root)
    monkeypatch.setenv("HOSTMEM_LOCK_TIMEOUT", "1")
    pid = _hold(folder + ".lock", uid)
    try:
        around = snapshot(tmp_path, [root])
        began = time.monotonic()
        outcome, said = start_elsewhere(world, root, timeout=60)
        took = time.monotonic() - began
    finally:
        _let_go(pid)
    assert f"pid {pid} (uid {os.geteuid() if uid is None else uid})" in said, said
    assert snapshot(tmp_path, [root]) == around
    if uid is not None:  # served from the cache, sealed, not merged in place
        assert outcome["equal"] and outcome["built"] == 0 and outcome["hit"] > 0, outcome
        assert "another user; serving the sealed combination" in said and "in place" not in said, said
    else:
        assert outcome["equal"] and outcome["hit"] == 0, outcome
        assert "in place" in said and "after 1 s (HOSTMEM_LOCK_TIMEOUT)" in said and took >= 1, said
    served = start_elsewhere(world, root)[0]  # once let go, the next start hits again
    assert served["equal"] and served["built"] == 0 and served["hit"] > 0, served


@contextlib.contextmanager
def _held_after_its_taker_exited(path: str):
    """``flock -x path sleep 60`` with the ``flock`` killed: its child, ``sleep``, keeps the
    lock's descriptor. Yields ``(taker pid, /proc/locks' holders)``; the child goes after."""
    import shutil
    import signal
    import subprocess

    from hostmem.vault.locks import lock_holders

    if shutil.which("flock") is None:
        pytest.skip("util-linux's flock is not installed")
    taker = subprocess.Popen(["flock", "-x", path, "sleep", "60"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not lock_holders(path):
            assert time.monotonic() < deadline, "flock never took the lock"
            time.sleep(0.02)
        taker.send_signal(signal.SIGKILL)
        taker.wait(timeout=10)
        yield taker.pid, lock_holders(path)
    finally:
        os.killpg(taker.pid, signal.SIGKILL)


def test_a_lock_whose_taker_exited_is_a_hold_of_ours_not_another_users(tmp_path):
    """``/proc/locks`` names the process that took a lock; a child it passed the descriptor to
    holds it after it exits (``flock FILE cmd``, then the ``flock`` killed). That pid is gone,
    not hidden: it was called another user's, never waited for, and a copy was built beside it."""
    from hostmem.vault.locks import GONE, describe_holders, foreign_hold, held_by_others

    path = os.fspath(tmp_path / "key.lock")
    open(path, "w").close()
    os.chmod(path, 0o600)
    with _held_after_its_taker_exited(path) as (taker, holders):
        assert holders == [(taker, GONE)]
        assert not held_by_others(holders) and not foreign_hold(holders, exposed=False)
        assert "exited" in describe_holders(holders) and "another user" not in describe_holders(holders)


def test_a_lock_whose_taker_exited_on_a_file_others_could_open_may_be_anyones(tmp_path):
    """The same hold on a lock file others could open (a root shared with ``chmod -R go+rX``):
    another user's ``flock FILE cmd &`` leaves it so, and a start waited the whole 30
    minutes for it, where another user's hold is never waited for."""
    from hostmem.vault.locks import GONE, foreign_hold

    path = os.fspath(tmp_path / "key.lock")
    open(path, "w").close()
    with _held_after_its_taker_exited(path) as (taker, holders):
        assert holders == [(taker, GONE)]
        assert foreign_hold(holders, exposed=True)  # anyone's: waited for no longer than another user's
        assert not foreign_hold(holders, exposed=False)  # only we could open it: a child of ours
