"""A second user on the machine, for real: steps run as ``nobody`` in a forked child.

The child is forked (no exec: the interpreter may live where ``nobody`` cannot read),
drops every group and takes ``nobody``'s uid and gid for real (``setgroups``,
``setgid``, ``setuid``), then does what a hostile user on the same host would. Tests
that need this skip cleanly where this process cannot switch uid (not root) or the
machine has no ``nobody``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pwd
import stat
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
def reachable_by_others(folder):
    """Let other users pass through ``folder``'s parents (``o+x``, no listing, no writing),
    as they pass through ``/`` to ``/tmp`` on a real host; every mode is put back after."""
    changed = []
    path = os.path.abspath(os.fspath(folder))
    while path != os.path.dirname(path):
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if not mode & stat.S_IXOTH:
            os.chmod(path, mode | stat.S_IXOTH)
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
