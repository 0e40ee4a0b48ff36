"""Finding and ending a process tree from /proc, on real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from hostmem.proctree import children_of, descendants_of, kill_tree, signal_tree

# a parent that starts a child, which starts a grandchild; each prints its pid and sleeps
TREE = r"""
import os, subprocess, sys, time
depth = int(sys.argv[1])
if depth:
    subprocess.Popen([sys.executable, "-c", sys.argv[2], str(depth - 1), sys.argv[2]])
print(os.getpid(), flush=True)
time.sleep(60)
"""


def start_tree() -> tuple[subprocess.Popen, list[int]]:
    """A three-process tree; its pids, root first."""
    proc = subprocess.Popen([sys.executable, "-c", TREE, "2", TREE], stdout=subprocess.PIPE, text=True)
    pids = sorted(int(proc.stdout.readline()) for _ in range(3))
    return proc, pids


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its reaper."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False


def wait_until(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_descendants_are_found_through_every_level():
    proc, pids = start_tree()
    try:
        (child,) = children_of(proc.pid)
        (grandchild,) = children_of(child)
        assert descendants_of(proc.pid) == [child, grandchild]
        assert sorted([proc.pid, child, grandchild]) == pids
        assert descendants_of(grandchild) == [] and children_of(grandchild) == []
    finally:
        kill_tree(proc.pid)
        proc.wait()


def test_kill_tree_ends_every_process_and_counts_them():
    proc, pids = start_tree()
    assert kill_tree(proc.pid) == 3
    assert proc.wait(timeout=10) == -signal.SIGKILL
    wait_until(lambda: not any(alive(pid) for pid in pids))  # the orphans' new parent reaps them
    assert kill_tree(proc.pid) == 0  # reaped: nothing left to kill


def test_signal_tree_reaches_each_process():
    proc, pids = start_tree()
    try:
        assert signal_tree(proc.pid, signal.SIGTERM) == 3
        assert proc.wait(timeout=10) == -signal.SIGTERM
        wait_until(lambda: not any(alive(pid) for pid in pids))
    finally:
        kill_tree(proc.pid)
    assert signal_tree(proc.pid, signal.SIGTERM) == 0


def test_a_pid_that_is_no_process_is_neither_signalled_nor_killed():
    missing = max(int(n) for n in os.listdir("/proc") if n.isdigit()) + 100_000
    assert signal_tree(missing, signal.SIGTERM) == 0 and kill_tree(missing) == 0
    assert children_of(missing) == [] and descendants_of(missing) == []
