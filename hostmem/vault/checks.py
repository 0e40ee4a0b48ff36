"""The checks every path of the cache passes: a regular file or a folder (never a link),
owned by this user (or root), writable by nobody else.

Below :mod:`.anchor` (which applies them to each descriptor it opens) and :mod:`.safety`
(which applies them to roots): see :mod:`.safety` for why they are what they are.
"""

from __future__ import annotations

import os
import stat

from ..errors import HostmemError

__all__ = ["VaultError", "RootChanged", "check_not_symlink", "check_folder_private", "check_owned", "check_folder_safe",
           "check_file_safe"]


class VaultError(HostmemError, ValueError):
    """The cache cannot be used as configured; the message names the path and the fix.

    A ``ValueError`` so that the command line prints it as one actionable line.
    """


class RootChanged(VaultError):
    """A root is no longer the folder checked when the cache opened it: refused outright,
    never worked around (no in-place merge, no copy beside it)."""


def _writable_by_others(path: str, st: os.stat_result, what: str) -> VaultError:
    """The refusal of a folder or file others can write; its advice gives a safe mode
    (``chmod +t`` would not: a sticky folder still takes others' new entries)."""
    who = "every user" if st.st_mode & stat.S_IWOTH else "its group"
    return VaultError(
        f"{path}: {what} writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}), so another user could plant "
        f"or swap cached weights. Run `chmod go-w {path}` (the cache makes its folders 0700 and its files "
        "0600), or choose another cache root."
    )


def check_folder_private(path: str, st: os.stat_result | None = None) -> None:
    """Refuse a folder that anyone but its owner may write into, sticky or not.

    Anyone who can create entries there could plant a layer file, a manifest or a memo
    under the name we will look up, or rename a combination onto another's key.
    """
    st = os.lstat(path) if st is None else st
    if stat.S_ISLNK(st.st_mode):
        check_not_symlink(path, st)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _writable_by_others(path, st, "a cache folder")


def check_file_safe(path: str, st: os.stat_result) -> None:
    """A file the cache trusts (a manifest, a memo, a record, a lock): a regular file, ours
    (or root's), and writable by nobody else."""
    if not stat.S_ISREG(st.st_mode):
        kind = ("a symlink" if stat.S_ISLNK(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                else "a folder" if stat.S_ISDIR(st.st_mode) else "a socket or other special file")
        raise VaultError(f"{path}: is {kind}, where the cache keeps a regular file of its own; the cache never "
                         "reads through it. Remove it (`rm` it) and start again.")
    check_owned(path, st, "file")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _writable_by_others(path, st, "a cache file")


def check_not_symlink(path: str, st: os.stat_result | None = None) -> os.stat_result:
    """Return ``lstat(path)``; refuse a symlink where the cache expects its own file."""
    st = os.lstat(path) if st is None else st
    if stat.S_ISLNK(st.st_mode):
        raise VaultError(
            f"{path}: is a symlink; the cache never follows links inside itself. Remove the link "
            "(`hostmem cache rm KEY` or `rm` it) and start again."
        )
    return st


def check_owned(path: str, st: os.stat_result, what: str = "folder") -> None:
    """Refuse a folder or file another user owns (root's are accepted, as sshd's StrictModes
    does): its owner could replace cached weights, even when its mode looks private to us."""
    if st.st_uid not in (os.geteuid(), 0):
        raise VaultError(
            f"{path}: owned by uid {st.st_uid} (a {what} of the cache), not by this user (uid {os.geteuid()}), "
            f"who could replace cached weights. `chown {os.geteuid()} {path}` if it is yours, or choose a cache root of your own "
            "(--root DIR, lora.cache.roots or HOSTMEM_CACHE_ROOT)."
        )


def check_folder_safe(path: str, st: os.stat_result | None = None) -> os.stat_result:
    """A cache folder that is there must be a real folder (no link), ours, and private
    (``st``: its ``lstat``, else taken by path)."""
    st = check_not_symlink(path, st)
    if not stat.S_ISDIR(st.st_mode):
        raise VaultError(f"{path}: exists and is not a folder; move it away or choose another cache root.")
    check_owned(path, st)
    check_folder_private(path, st)
    return st
