"""The whole path to a cache root, trusted or refused, and the root opened by that walk.

Checking only the root leaves every folder above it: another user who may write a
folder on the way (their own folder, a 0777 one) can swap the next name for a link, and
the cache is then built, pruned or read wherever it points. So a root is trusted the
way sshd's ``StrictModes`` trusts a home folder and git's ``safe.directory`` a
repository: walked from ``/`` one name at a time, each folder opened relative to the one
before with ``O_NOFOLLOW | O_DIRECTORY`` and checked on its descriptor:

- owned by root or this user;
- writable by nobody else, unless sticky (``/tmp``'s mode: others cannot rename or
  remove what is not theirs, and the next name must be root's or this user's anyway);
- a link on the way must be root's or this user's, and is then walked the same way.

The walk yields the root's descriptor: :mod:`.anchor` keeps its identity (device and
inode), so a root swapped after the check is never entered.
"""

from __future__ import annotations

import errno
import os
import stat

from .checks import VaultError

__all__ = ["walk_to", "path_refusal"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_LINKS = 40  # as the kernel's own limit: a loop of links is refused, not walked for ever


def _trusted_owner(uid: int) -> bool:
    return uid in (0, os.geteuid())


def _fix(path: str, owner_trusted: bool) -> str:
    """What makes ``path`` trusted: a sticky bit helps a writable folder of a trusted owner,
    never a folder another user owns (who may swap what is in it whatever its bits)."""
    sticky = f" (or `chmod +t {path}` where others must share it)" if owner_trusted else ""
    return (f"Run `sudo chown root:root {path} && sudo chmod go-w {path}`{sticky}, or choose a cache root whose "
            "every folder is yours or root's (--root DIR, lora.cache.roots or HOSTMEM_CACHE_ROOT)")


def path_refusal(path: str, st: os.stat_result, root: str) -> VaultError | None:
    """Why folder ``path`` (on the way to ``root``) is not one the cache may trust, or None."""
    mode = stat.S_IMODE(st.st_mode)
    if not _trusted_owner(st.st_uid):
        why = f"owned by uid {st.st_uid} (mode {mode:04o}), not by root or this user (uid {os.geteuid()})"
    elif mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX:
        who = "every user" if mode & stat.S_IWOTH else "its group"
        why = f"writable by {who} (mode {mode:04o}, owner uid {st.st_uid}) and not sticky"
    else:
        return None
    return VaultError(f"{path}: a folder on the way to the cache root {root}, {why}: whoever can write it can "
                      f"swap the cache for a link to anywhere. {_fix(path, _trusted_owner(st.st_uid))}.")


def _link_refusal(path: str, st: os.stat_result, root: str) -> VaultError:
    where = "" if path == root else f" (on the way to the cache root {root})"
    return VaultError(f"{path}: a link made by uid {st.st_uid}{where}, not by this user (uid {os.geteuid()}) or "
                      f"root, so it may point anywhere. Remove it (`rm {path}`, or "
                      "ask its owner) or choose a cache root of your own (--root DIR, lora.cache.roots or "
                      "HOSTMEM_CACHE_ROOT).")


def _not_a_folder(path: str) -> VaultError:
    return VaultError(f"{path}: exists and is not a folder; move it away or choose another cache root.")


class _Walk:
    """One walk from ``/``: the folders opened so far (for ``..``), links followed."""

    def __init__(self, root: str, create: bool):
        self.root, self.create = root, create
        self.stack: list[tuple[int, str]] = []
        self.links = 0

    def close(self) -> None:
        for fd, _ in self.stack:
            os.close(fd)
        self.stack.clear()

    def start_at_slash(self) -> None:
        self.close()
        fd = os.open("/", _DIR_FLAGS)
        self.stack.append((fd, "/"))
        self._check(fd, "/", last=False)

    def _check(self, fd: int, path: str, last: bool) -> None:
        st = os.fstat(fd)
        refused = None if last else path_refusal(path, st, self.root)
        if refused is not None:
            raise refused

    def step(self, name: str, last: bool) -> list[str]:
        """Enter ``name``; the names of a link's target to walk first, if it was a link."""
        fd, here = self.stack[-1]
        path = os.path.join(here, name)
        try:
            nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if not self.create:
                raise
            return self._make(fd, name, last)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            return self._link(fd, name, path, last)
        self.stack.append((nxt, path))
        self._check(nxt, path, last)
        return []

    def _make(self, fd: int, name: str, last: bool) -> list[str]:
        """Create folder ``name`` (another process may make it first: it is then walked as
        any folder found is) and enter it."""
        try:
            os.mkdir(name, 0o700 if last else 0o755, dir_fd=fd)
        except FileExistsError:
            return [name]  # made meanwhile (another start): walked, checked, as found
        nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
        os.fchmod(nxt, 0o700 if last else 0o755)  # exactly that, whatever the umask
        path = os.path.join(self.stack[-1][1], name)
        self.stack.append((nxt, path))
        self._check(nxt, path, last)
        return []

    def _link(self, fd: int, name: str, path: str, last: bool) -> list[str]:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if not stat.S_ISLNK(st.st_mode):
            if last:
                raise _not_a_folder(path)
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
        if not _trusted_owner(st.st_uid):
            raise _link_refusal(path, st, self.root)
        self.links += 1
        if self.links > _MAX_LINKS:
            raise VaultError(f"{path}: too many links on the way to the cache root {self.root}; choose another root.")
        target = os.readlink(name, dir_fd=fd)
        if target.startswith("/"):
            self.start_at_slash()
        return [n for n in target.split("/") if n]

    def up(self) -> None:
        if len(self.stack) > 1:
            os.close(self.stack.pop()[0])


def walk_to(root: str, create: bool = False) -> int:
    """The descriptor of folder ``root`` (absolute), opened by a walk from ``/`` that trusts
    every folder and link on the way (see the module's docstring), creating missing ones
    with ``create`` (0755 on the way, 0700 the root). The root itself is not checked here
    (the caller checks it as a cache folder). ``FileNotFoundError`` without ``create``
    where a folder is missing; :class:`VaultError` naming what is refused."""
    walk = _Walk(root, create)
    try:
        walk.start_at_slash()
        names = [n for n in root.split("/") if n]
        while names:
            name = names.pop(0)
            if name == ".":
                continue
            if name == "..":
                walk.up()
                continue
            names[:0] = walk.step(name, last=not names)
        fd = walk.stack.pop()[0]
    finally:
        walk.close()
    return fd
