"""The shared build's failure words: which rank died (a real child process, killed), and
which errors say the disk had no room."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from hostmem.vault import VaultError
from lora_cache.ranks.faults import RankDiedError, RankWatch, _started, cannot_store


def test_a_watched_rank_whose_process_is_killed_is_named_and_a_live_one_never():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watch = RankWatch([(0, (os.getpid(), _started(os.getpid()))), (1, (child.pid, _started(child.pid)))], 0)
        with pytest.raises(RuntimeError, match="^Broken pipe$"):  # nobody died: the error as it was
            with watch.naming_the_dead("a test"):
                raise RuntimeError("Broken pipe")
        child.kill()
        child.wait()
        with pytest.raises(RankDiedError, match=rf"rank 1 \(pid {child.pid}\) died during a test: .* this rank \(0\)"):
            with watch.naming_the_dead("a test"):
                raise RuntimeError("Broken pipe")
    finally:
        child.kill()
        child.wait()


def test_a_rank_this_process_could_not_see_when_they_met_is_never_judged():
    assert RankWatch([(1, (2 ** 22 + 1, None))], 0).processes == {}


def test_no_room_is_told_from_other_failures_through_the_errors_it_was_raised_from():
    try:
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            raise VaultError("cannot create the LoRA merge cache folder") from None
    except VaultError as exc:
        assert cannot_store(exc)
    assert cannot_store(RuntimeError("no room for the LoRA merge cache in a root: needs 2 MiB"))
    assert not cannot_store(OSError(errno.EIO, os.strerror(errno.EIO)))
    assert not cannot_store(VaultError("another user's folder"))
