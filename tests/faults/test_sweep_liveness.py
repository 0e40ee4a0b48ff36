"""The dead-writer sweep goes by the writer's lock, a kernel fact, never by the pid in a name.

A writer holds an flock on its temporary file until it renames it into place; the
kernel drops it when the writer dies. So a live writer's file survives a sweep, in this
pid namespace or another one sharing the root, and a SIGKILLed writer's file is swept.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from hostmem.vault.combinations import sweep_dead_temporaries
from hostmem.vault.durable import TMP_PREFIX, durable_write
from hostmem.vault.locks import pid_exited

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEY = "ab" * 32  # a combination folder's name

# Writes a temporary file in each folder given, prints each path, then waits for stdin to close.
WRITER = """
    import sys
    from hostmem.vault.durable import open_tmp, write_all
    for folder in sys.argv[1:]:
        fd, path = open_tmp(folder, ".safetensors")
        write_all(fd, b"half a layer" * 1000, 0)
        print(path, flush=True)
    sys.stdin.read()
"""


def is_running_here(pid: int) -> bool:
    """Whether a process ``pid`` exists in this pid namespace."""
    return not pid_exited(pid)


def start_writer(launch: list[str], *folders: str) -> tuple[subprocess.Popen, list[str]]:
    """A real writer process (``launch`` runs the code given after it), in its own process
    group; returns it and the files it holds."""
    proc = subprocess.Popen(
        [*launch, textwrap.dedent(WRITER), *folders],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=REPO, start_new_session=True,
    )
    paths = [proc.stdout.readline().strip() for _ in folders]
    assert all(paths), proc.stderr.read()
    return proc, paths


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the writer and every process of its group, and reap it."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdin.close()
    proc.stdout.close()
    proc.stderr.close()


def sweep_until_gone(cache: str, paths: list[str], seconds: float = 10.0) -> int:
    """Sweep until ``paths`` are gone (a killed process's descriptors close as it is torn down)."""
    removed, deadline = 0, time.monotonic() + seconds
    while any(os.path.exists(p) for p in paths) and time.monotonic() < deadline:
        removed += sweep_dead_temporaries(cache)
        time.sleep(0.05)
    return removed


@pytest.fixture
def cache(tmp_path):
    folder = tmp_path / "lora_merge_cache"
    (folder / KEY).mkdir(parents=True)
    return str(folder)


def test_a_live_writers_files_survive_and_a_killed_ones_are_swept(cache):
    proc, paths = start_writer([sys.executable, "-c"], cache, os.path.join(cache, KEY))
    try:
        assert sweep_dead_temporaries(cache) == 0
        assert all(os.path.getsize(p) == 12000 for p in paths)
    finally:
        kill_group(proc)
    assert sweep_until_gone(cache, paths) == 2
    assert os.listdir(cache) == [KEY] and os.listdir(os.path.join(cache, KEY)) == []


def test_a_provider_folder_that_is_no_key_is_swept_too(cache):
    """A provider's records (``conversions/``) are written the same way, so a killed
    writer's temporary file there goes too, and a live one's stays."""
    records = os.path.join(cache, "conversions")
    os.mkdir(records)
    proc, paths = start_writer([sys.executable, "-c"], records)
    try:
        assert sweep_dead_temporaries(cache) == 0 and os.path.exists(paths[0])
    finally:
        kill_group(proc)
    assert sweep_until_gone(cache, paths) == 1
    assert os.listdir(records) == []


def test_a_name_carrying_a_live_pid_does_not_keep_an_abandoned_file(cache):
    """The pid in a name may be reused, or mean another namespace's process: it decides nothing."""
    stray = os.path.join(cache, f"{TMP_PREFIX}{os.getpid()}-0badf00d")
    with open(stray, "wb") as handle:
        handle.write(b"left by a writer whose pid is now this process's")
    assert is_running_here(os.getpid())
    assert sweep_dead_temporaries(cache) == 1 and not os.path.exists(stray)


def _unshare_works() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    return probe.returncode == 0


def _pid_not_running_here() -> int:
    """A pid no process of this namespace has now, for the other namespace's writer to take."""
    top = int(open("/proc/sys/kernel/pid_max").read())
    return next(pid for pid in range(top - 2, 300, -1) if not is_running_here(pid))


# In a new pid namespace: set its next pid, then fork the writer, which gets exactly that pid.
IN_NAMESPACE = """
    import os, sys
    with open("/proc/sys/kernel/ns_last_pid", "w") as handle:
        handle.write(str(int(sys.argv[1]) - 1))
    if os.fork() == 0:
        code, sys.argv[1:] = sys.argv[2], sys.argv[3:]
        exec(code)
    os.wait()
"""


@pytest.mark.skipif(not _unshare_works(), reason="needs root and unshare --pid (util-linux)")
def test_a_writer_in_another_pid_namespace_survives_while_it_lives(cache):
    """Its name carries a pid that, seen from here, no process has: the old pid rule took its file."""
    pid = _pid_not_running_here()
    unshare = ["unshare", "--pid", "--fork", "--mount-proc"]
    proc, (path,) = start_writer([*unshare, sys.executable, "-c", textwrap.dedent(IN_NAMESPACE), str(pid)], cache)
    try:
        assert os.path.basename(path).startswith(f"{TMP_PREFIX}{pid}-") and not is_running_here(pid)
        assert sweep_dead_temporaries(cache) == 0 and os.path.exists(path)
    finally:
        kill_group(proc)
    assert sweep_until_gone(cache, [path]) == 1


def test_sweeps_racing_writers_never_take_a_file_from_under_one(cache):
    """A sweep may take a new file's lock before its writer does; the writer then starts over."""
    stop = threading.Event()

    def sweep_all_the_time():
        while not stop.is_set():
            sweep_dead_temporaries(cache)

    sweeper = threading.Thread(target=sweep_all_the_time)
    sweeper.start()
    try:
        for i in range(300):
            durable_write(os.path.join(cache, "memo.json"), b"%d" % i)
    finally:
        stop.set()
        sweeper.join()
    with open(os.path.join(cache, "memo.json"), "rb") as handle:
        assert handle.read() == b"299"
    assert sorted(os.listdir(cache)) == [KEY, "memo.json"]


def test_only_regular_files_are_taken_for_a_writers_leftovers(cache):
    """A fifo or a folder planted under a temporary name is nothing a writer left: it stays."""
    fifo, folder = (os.path.join(cache, f"{TMP_PREFIX}1-{tag}") for tag in ("fifo", "folder"))
    os.mkfifo(fifo)
    os.mkdir(folder)
    assert sweep_dead_temporaries(cache) == 0
    assert os.path.exists(fifo) and os.path.isdir(folder)
