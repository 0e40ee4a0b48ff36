"""No lock of the cache waits for ever on another user, and none sends a start to the in-place merge.

An operator shares a cache (``chmod -R go+rX``); another user (``nobody``, for real)
then opens its lock files read-only and holds a flock on them for as long as they like.
Each start runs in a thread joined with a generous limit, so that a wait without end
fails the test instead of hanging it; ``HOSTMEM_LOCK_TIMEOUT`` keeps the bounded waits
short. Every weight served is ``torch.equal`` to what was built, and the start maps it
from the cache (a sealed session, or a copy of this user's own), never in place.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from hostmem.vault import Vault
from hostmem.vault.combinations import lock_path, use_path
from hostmem.vault.store import alternate_key
from lora_cache.kernels.wisdom import WISDOM_FILE, Wisdom
from tests.hostmem.vault.test_vault import build, expected_of, key_for, layers

from .users import flock_held_by_nobody, nobody, open_to_others, reachable_by_others

HANG = 60.0  # far past every bounded wait here: a thread still running then waits for ever


@pytest.fixture(autouse=True)
def short_waits(monkeypatch):
    monkeypatch.setenv("HOSTMEM_LOCK_TIMEOUT", "0.3")


def _in_thread(fn):
    """``fn()``'s result, run in a thread that must end (a wait without end fails here)."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(HANG)
    assert not thread.is_alive(), "the start waited for ever on another user's lock"
    assert out, "the start raised (see the thread's traceback above)"
    return out[0]


def _shared_world(tmp_path, tag: str, sealed: bool = True):
    nobody()
    root = str(tmp_path / "root")
    vault, key, tensors = Vault(root), key_for(tag), layers(count=2)
    if sealed:
        build(vault, key, tensors)
    return vault, key, tensors


def _serve(vault: Vault, key, tensors: dict):
    """A start's gets: the session and how many layers it mapped from the cache."""
    session = Vault(vault.root).open(key, expected_of(tensors))
    served = 0
    for name, tensor in tensors.items():
        view = session.get(name, tuple(tensor.shape), tensor.dtype)
        if view is not None:
            assert torch.equal(view, tensor)
            served += 1
    return session, served


def test_another_users_hold_on_the_use_lock_serves_the_sealed_combination_without_waiting_for_ever(tmp_path, capfd):
    vault, key, tensors = _shared_world(tmp_path, "use-held")
    with open(use_path(vault.cache, key.hex), "a"):
        pass  # left by a start whose weights were dropped since; the operator's chmod opens it
    open_to_others(vault.root)
    with reachable_by_others(vault.root), flock_held_by_nobody(use_path(vault.cache, key.hex)):
        session, served = _in_thread(lambda: _serve(vault, key, tensors))
        session.close()
    assert served == len(tensors) and session.last_error is None or "sealed and verified" in session.last_error
    said = capfd.readouterr().err
    assert f"(uid {nobody()[0]})" in said and "serving without it" in said
    assert "readable by other users" in said and "chmod -R go-rwx" in said


def test_another_users_hold_on_the_key_lock_serves_the_sealed_combination_not_in_place(tmp_path, capfd):
    vault, key, tensors = _shared_world(tmp_path, "key-held-sealed")
    open_to_others(vault.root)
    _serve(vault, key, tensors)[0].close()  # a start after the chmod checks every layer again (their ctimes moved)
    with open(lock_path(vault.cache, key.hex), "a"):
        pass  # left by a start that was killed
    os.chmod(lock_path(vault.cache, key.hex), 0o644)  # and opened by the operator's chmod
    with reachable_by_others(vault.root), flock_held_by_nobody(lock_path(vault.cache, key.hex)):
        session, served = _in_thread(lambda: _serve(vault, key, tensors))
        session.close()
    assert served == len(tensors) and session.key == key.hex
    assert f"(uid {nobody()[0]}), another user; serving the sealed combination" in capfd.readouterr().err


def test_another_users_hold_on_the_key_lock_builds_a_copy_of_this_users_own_not_in_place(tmp_path, capfd):
    vault, key, tensors = _shared_world(tmp_path, "key-held-new", sealed=False)
    with open(lock_path(vault.cache, key.hex), "a"):
        pass
    open_to_others(vault.root)
    with reachable_by_others(vault.root), flock_held_by_nobody(lock_path(vault.cache, key.hex)):
        stats = _in_thread(lambda: build(Vault(vault.root), key, tensors))
        session, served = _in_thread(lambda: _serve(vault, key, tensors))
        session.close()
    assert stats["layers_written"] == len(tensors) and served == len(tensors)
    assert session.key == alternate_key(key.hex, 1)
    assert os.path.isdir(os.path.join(vault.cache, alternate_key(key.hex, 1)))
    assert f"(uid {nobody()[0]})" in capfd.readouterr().err


def test_an_image_built_beside_another_users_lock_is_served_from_the_read_only_root(tmp_path, read_only_copy):
    """An image built (as by ``hostmem lora merge``) while another user held the key's lock
    is under the key's first alternate; a server reading the image from a read-only root
    serves it from there (it looked under the key alone, so every server built it again)."""
    vault, key, tensors = _shared_world(tmp_path, "image-beside", sealed=False)
    with open(lock_path(vault.cache, key.hex), "a"):
        pass
    open_to_others(vault.root)
    with reachable_by_others(vault.root), flock_held_by_nobody(lock_path(vault.cache, key.hex)):
        _in_thread(lambda: build(Vault(vault.root), key, tensors))
    image = Vault(read_only_copy(vault.root))
    assert image.read_only
    session = image.open(key, expected_of(tensors))
    try:
        assert session.key == alternate_key(key.hex, 1) and session.complete
        for name, tensor in tensors.items():
            assert torch.equal(session.get(name, tuple(tensor.shape), tensor.dtype), tensor), name
    finally:
        session.close()


def test_another_users_hold_on_the_wisdom_lock_times_the_kernels_here_within_the_bound(tmp_path):
    nobody()
    root = str(tmp_path / "root")
    os.mkdir(root, 0o700)
    lock = os.path.join(root, WISDOM_FILE + ".lock")
    with open(lock, "a"):
        pass
    open_to_others(root)
    wisdom = Wisdom(root)

    def record_one():
        with wisdom.recording() as record:
            return record("shape-class", lambda: {"kernel": "fp32"})

    with reachable_by_others(root), flock_held_by_nobody(lock):
        with pytest.warns(UserWarning, match=rf"kernel wisdom not recorded: .* \(uid {nobody()[0]}\)"):
            assert _in_thread(record_one) == {"kernel": "fp32"}
    assert not wisdom.writable and not os.path.exists(os.path.join(root, WISDOM_FILE))


_OWNER = 4242  # the cache's owner in the tests below: a user with no other process on the machine


def _as_owner_start(root: str, key, tensors: dict, said_to) -> None:
    """In a forked child set up as the test wants: a start as the cache's owner (a build,
    then a session serving it); what it did, to ``said_to`` as JSON. Never returns."""
    import json

    code = 1
    try:
        os.setgroups([])
        os.setgid(_OWNER)
        os.setuid(_OWNER)
        built = build(Vault(root), key, tensors)["layers_written"]
        session, served = _serve(Vault(root), key, tensors)
        session.close()
        os.write(said_to, json.dumps({"key": session.key, "built": built, "served": served,
                                      "error": session.last_error}).encode())
        code = 0
    except BaseException as exc:  # noqa: BLE001 (said to the parent, which fails)
        os.write(said_to, json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
    finally:
        os._exit(code)


def _in_namespaces(flags: int, proc_options: list[str], said_to: int, then) -> None:
    """In a forked child: ``unshare(flags)`` (a pid namespace's first process forked after
    it), /proc mounted anew with ``proc_options`` in a private mount namespace, then
    ``then()``; a failure to set this up is said as ``{"failed": ...}``, for a skip."""
    import ctypes
    import json
    import subprocess

    try:
        if ctypes.CDLL(None, use_errno=True).unshare(flags) != 0:
            raise OSError(ctypes.get_errno(), f"unshare({flags:#x})")
        if flags & 0x20000000:  # CLONE_NEWPID: the namespace begins with the next child
            pid = os.fork()
            if pid:
                _, status = os.waitpid(pid, 0)
                os._exit(os.waitstatus_to_exitcode(status))
        for cmd in (["mount", "--make-rprivate", "/"], ["mount", "-t", "proc", *proc_options, "proc", "/proc"]):
            subprocess.run(cmd, check=True, capture_output=True)
    except BaseException as exc:  # noqa: BLE001 (said to the parent, which skips)
        os.write(said_to, json.dumps({"failed": f"unshare or mount: {type(exc).__name__}: {exc}"}).encode())
        os._exit(1)
    then()


def _start_held_by_nobody(tmp_path, tag: str, flags: int, proc_options: list[str]):
    """The owner's root, opened to others by the operator's chmod, with a key lock left
    by a killed start and held by nobody; a start in the namespaces ``flags`` make:
    ``(what it said, the key, the tensors, the lock's path)``."""
    import functools
    import json

    nobody()
    root = str(tmp_path / "root")
    cache = os.path.join(root, "lora_merge_cache")
    os.makedirs(cache)
    key, tensors = key_for(tag), layers(count=2)
    lock = lock_path(cache, key.hex)
    with open(lock, "a"):
        pass
    for here, dirs, files in os.walk(root):
        for name in [here, *(os.path.join(here, f) for f in files)]:
            os.chown(name, _OWNER, _OWNER)
    open_to_others(root)  # the operator's chmod: nobody can open the lock
    with reachable_by_others(root, opened=True), flock_held_by_nobody(lock):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            _in_namespaces(flags, proc_options, write, functools.partial(_as_owner_start, root, key, tensors, write))
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            said = json.loads(pipe.read().decode() or "{}")
        os.waitpid(pid, 0)
    if "failed" in said:
        pytest.skip(f"no such namespaces here: {said['failed']}")
    return said, key, tensors, lock


def test_another_users_hold_hidden_by_proc_is_known_as_anothers_and_never_waited_for(tmp_path):
    """On a host whose /proc hides other users' processes (``hidepid=2``), the holder of a
    key's lock has no /proc entry this user can see. This user's own processes are always
    seen, so the holder is another user's: the start builds a copy of its own at once, as
    where /proc shows it, not after the whole bounded wait and never in place."""
    said, key, tensors, _ = _start_held_by_nobody(tmp_path, "hidden-holder", 0x00020000, ["-o", "hidepid=2"])
    assert said.get("key") == alternate_key(key.hex, 1), said
    assert said["error"] is None or "sealed and verified" in said["error"]  # served from the copy it built
    assert said["built"] == said["served"] == len(tensors)
    assert nobody()[0] != _OWNER


def test_a_hold_from_outside_this_containers_pid_namespace_on_a_shared_lock_is_never_waited_for(tmp_path):
    """From a container (a pid namespace of its own), /proc/locks lists no holder outside
    it: another user's hold on a lock file the operator's chmod opened to others is unseen.
    The start counts an unseen holder of such a file as maybe another user's and builds a
    copy of its own at once, as where the holder is seen; never the whole bounded wait,
    never in place. The lock file is closed to others (0600) from then on."""
    import stat

    said, key, tensors, lock = _start_held_by_nobody(tmp_path, "unseen-holder", 0x00020000 | 0x20000000, [])
    assert said.get("key") == alternate_key(key.hex, 1), said
    assert said["built"] == said["served"] == len(tensors)
    assert stat.S_IMODE(os.stat(lock).st_mode) == 0o600


def test_removing_a_combination_another_user_holds_names_them_and_what_to_do(tmp_path):
    from hostmem.vault import VaultError
    from hostmem.vault.admin import remove

    vault, key, tensors = _shared_world(tmp_path, "rm-held")
    with open(lock_path(vault.cache, key.hex), "a"):
        pass
    open_to_others(vault.root)
    with reachable_by_others(vault.root), flock_held_by_nobody(lock_path(vault.cache, key.hex)):
        with pytest.raises(VaultError, match=rf"held by pid \d+ \(uid {nobody()[0]}\), another user.*chmod -R go-rwx"):
            remove(vault.cache, key.hex)
    assert os.path.isdir(os.path.join(vault.cache, key.hex))


def test_prune_names_a_combination_another_user_pins_with_its_use_file(tmp_path, capfd):
    """Another user holding a combination's .use file keeps prune from removing it; the
    prune says so and who it is (it said "removed 0 combination(s)" and nothing else)."""
    from hostmem.vault.admin import prune

    vault, key, tensors = _shared_world(tmp_path, "prune-held")
    with open(use_path(vault.cache, key.hex), "a"):
        pass  # left by a start whose weights were dropped since; the operator's chmod opens it
    open_to_others(vault.root)
    with reachable_by_others(vault.root), flock_held_by_nobody(use_path(vault.cache, key.hex)):
        assert prune(vault.cache, everything=True) == []
    said = capfd.readouterr().err
    assert f"left {key.hex[:12]} alone: in use (held by pid" in said and f"(uid {nobody()[0]}), another user" in said, said
    assert os.path.isdir(os.path.join(vault.cache, key.hex))
