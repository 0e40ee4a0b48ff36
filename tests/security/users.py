"""A second user on the machine, for real: steps run as ``nobody`` in a forked child.

The child is forked (no exec: the interpreter may live where ``nobody`` cannot read),
drops every group and takes ``nobody``'s uid and gid for real (``setgroups``,
``setgid``, ``setuid``), then does what a hostile user on the same host would. Tests
that need this skip cleanly where this process cannot switch uid (not root) or the
machine has no ``nobody``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import pwd
import stat
import tempfile
import traceback

import pytest


def nobody() -> tuple[int, int]:
    """``nobody``'s uid and gid; skips the test where switching to it is not possible."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run steps as a second user (nobody)")
    try:
        entry = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("this machine has no user nobody")
    return entry.pw_uid, entry.pw_gid


def as_nobody(step, *args) -> None:
    """Run ``step(*args)`` as ``nobody`` in a forked child; its error fails the test."""
    uid, gid = nobody()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            step(*args)
        except BaseException:
            os.write(write, traceback.format_exc().encode())
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        said = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the step as nobody failed:\n{said}"


@contextlib.contextmanager
def reachable_by_others(folder, opened: bool = False):
    """Let other users pass through ``folder``'s parents (``o+x``, no listing, no writing),
    as they pass through ``/`` to ``/tmp`` on a real host; every mode is put back after.
    ``opened``: they may also open them (``o+r``), as a cache root's owner walks every
    folder from ``/`` down by descriptor.

    The parents above a test's own folder are the run's, shared by every worker of a
    parallel run (pytest -n): one worker putting a mode back while another's ``nobody``
    passes through would fail the other, so the sections take turns (a lock in the run's
    temp folder)."""
    changed = []
    with open(os.path.join(tempfile.gettempdir(), "hostmem-reachable.lock"), "a") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX)
        path = os.path.abspath(os.fspath(folder))
        while path != os.path.dirname(path):
            mode = stat.S_IMODE(os.stat(path).st_mode)
            wanted = stat.S_IXOTH | (stat.S_IROTH if opened else 0)
            if mode & wanted != wanted:
                os.chmod(path, mode | wanted)
                changed.append((path, mode))
            path = os.path.dirname(path)
        try:
            yield
        finally:
            for path, mode in changed:
                os.chmod(path, mode)


def shared_folder(tmp_path) -> str:
    """A folder every user may create entries in, sticky (the mode of ``/tmp``)."""
    path = os.path.join(tmp_path, "shared")
    os.mkdir(path)
    os.chmod(path, 0o1777)
    return path


def snapshot(folder, leave_out=()) -> dict[str, tuple]:
    """Every entry under ``folder`` but those under ``leave_out``: its kind, mode, owner,
    size and content digest (links: their target), to show nothing else was created,
    written or removed."""
    leave_out = tuple(os.path.abspath(os.fspath(p)) for p in leave_out)
    found = {}
    for here, dirs, files in os.walk(os.fspath(folder)):
        dirs[:] = [d for d in dirs if not os.path.join(here, d).startswith(leave_out)]
        for name in dirs + files:
            path = os.path.join(here, name)
            if path.startswith(leave_out):
                continue
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                with open(path, "rb") as handle:
                    content = hashlib.sha256(handle.read()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                content = os.readlink(path)
            else:
                content = None
            found[path] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, st.st_size, content)
    return found


@contextlib.contextmanager
def flock_held_by_nobody(path, exclusive: bool = True):
    """``nobody`` holds a flock on ``path`` (opened read-only, as anyone who can read a
    file may) until the block ends; the holder is a forked child, ended on leaving."""
    import fcntl

    uid, gid = nobody()
    ready_r, ready_w = os.pipe()
    stop_r, stop_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(ready_r)
            os.close(stop_w)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            fd = os.open(os.fspath(path), os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            os.write(ready_w, b"1")
            os.read(stop_r, 1)  # until the parent closes its end
            code = 0
        except BaseException:
            os.write(ready_w, traceback.format_exc().encode())
        finally:
            os._exit(code)
    os.close(ready_w)
    os.close(stop_r)
    said = os.read(ready_r, 4096)
    os.close(ready_r)
    try:
        assert said == b"1", f"nobody could not lock {path}:\n{said.decode()}"
        yield pid
    finally:
        os.close(stop_w)
        os.waitpid(pid, 0)


def open_to_others(folder) -> None:
    """What an operator does to share a cache (``chmod -R go+rX``): every folder and file
    under ``folder`` readable by others, folders passable."""
    for here, dirs, files in os.walk(os.fspath(folder)):
        for name in [*dirs, ""]:
            path = os.path.join(here, name)
            os.chmod(path, stat.S_IMODE(os.stat(path).st_mode) | 0o055)
        for name in files:
            path = os.path.join(here, name)
            if not os.path.islink(path):
                os.chmod(path, stat.S_IMODE(os.stat(path).st_mode) | 0o044)
