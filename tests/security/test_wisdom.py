"""Kernel wisdom steers which sum a merge runs: trusted only as the cache's own files are.

A link planted where the file or its lock go is never followed (nothing is created where
it points), a FIFO or device is never read, a file of another user's is set aside, and
an entry that is not a dict is no entry; each says so as a warning, and the kernels are
then timed in this process.
"""

from __future__ import annotations

import json
import os
import threading

import pytest

from lora_cache.kernels.wisdom import ENTRIES, FACTS, WISDOM_FILE, Wisdom

from .users import snapshot


def _root(tmp_path) -> str:
    root = str(tmp_path / "root")
    os.mkdir(root, 0o700)
    return root


def _write(path: str, sections: dict) -> None:
    with open(path, "w") as handle:
        json.dump({"version": 1, ENTRIES: {}, **sections}, handle)


def test_a_link_planted_as_the_wisdom_lock_creates_nothing_where_it_points(tmp_path):
    root = _root(tmp_path)
    target = str(tmp_path / "elsewhere" / "made-by-the-start")
    os.mkdir(os.path.dirname(target))
    os.symlink(target, os.path.join(root, WISDOM_FILE + ".lock"))
    around = snapshot(tmp_path, [root])
    wisdom = Wisdom(root)
    with pytest.warns(UserWarning, match=r"kernel wisdom not used: .*\.lock: is a symlink"):
        with wisdom.recording() as record:
            assert record("k", lambda: {"kernel": "fp32"}) == {"kernel": "fp32"}
    assert not wisdom.writable and not os.path.lexists(target)
    assert snapshot(tmp_path, [root]) == around


@pytest.mark.parametrize("planted", ["fifo", "link to /dev/zero", "link to a file"])
def test_a_special_file_or_link_as_the_wisdom_is_never_read(tmp_path, planted):
    root = _root(tmp_path)
    path = os.path.join(root, WISDOM_FILE)
    if planted == "fifo":
        os.mkfifo(path, 0o600)
    elif planted == "link to /dev/zero":
        os.symlink("/dev/zero", path)
    else:
        elsewhere = str(tmp_path / "theirs.json")
        _write(elsewhere, {FACTS: {"k": {"rounds_once": True}}})
        os.symlink(elsewhere, path)
    found = []
    reader = threading.Thread(target=lambda: found.append(Wisdom(root).recall("k", FACTS)), daemon=True)
    with pytest.warns(UserWarning, match=r"kernel wisdom not used: .*is a (FIFO|symlink)"):
        reader.start()
        reader.join(20)
    if reader.is_alive():  # hung on the FIFO: let it go before failing
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(5)
        pytest.fail("reading the kernel wisdom hung on a FIFO")
    assert found == [None]


def test_wisdom_another_user_owns_is_set_aside(tmp_path):
    root = _root(tmp_path)
    path = os.path.join(root, WISDOM_FILE)
    _write(path, {FACTS: {"k": {"rounds_once": True}}})
    os.chown(path, 65534, 65534)
    with pytest.warns(UserWarning, match=r"owned by uid 65534"):
        assert Wisdom(root).recall("k", FACTS) is None


def test_wisdom_in_a_root_others_can_write_is_set_aside(tmp_path):
    root = _root(tmp_path)
    _write(os.path.join(root, WISDOM_FILE), {FACTS: {"k": {"rounds_once": True}}})
    os.chmod(root, 0o1777)
    with pytest.warns(UserWarning, match=r"writable by every user"):
        assert Wisdom(root).recall("k", FACTS) is None


def test_an_entry_that_is_not_a_dict_is_no_entry(tmp_path):
    root = _root(tmp_path)
    _write(os.path.join(root, WISDOM_FILE), {ENTRIES: {"k": "fp32", "j": {"kernel": "fp32"}}})
    wisdom = Wisdom(root)
    assert wisdom.recall("k") is None and wisdom.recall("j") == {"kernel": "fp32"}
