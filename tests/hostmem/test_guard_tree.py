"""``hostmem guard`` counts the whole process tree: in a memory cgroup, or by a tree scan.

Real trees: a shell script whose child allocates, a daemon that double-forks and
re-parents away from the command, forked children that share their parent's pages.
The memory-cgroup tests run where this machine lets a process nest a memory cgroup
under its own, and are skipped elsewhere; the tree-scan tests run everywhere.
"""

from __future__ import annotations

import json
import os
import tempfile
import subprocess
import sys
import textwrap

import psutil
import pytest

from hostmem.cgroup_sandbox import can_nest_memory_cgroup
from hostmem.procfs import memory_cgroup_dir
from hostmem.guard import run_guarded
from tests.hostmem.test_peak import wait_for

MiB = 1024 * 1024
NO_CGROUP = can_nest_memory_cgroup()
needs_cgroup = pytest.mark.skipif(NO_CGROUP is not None, reason=f"no nested memory cgroup here: {NO_CGROUP}")
MODES = [pytest.param("cgroup", marks=needs_cgroup), "tree"]

# The command is a shell script; its child allocates and touches N MiB, holds it, exits.
ALLOCATE = "import sys, time; b = b'\\x01' * ({mib} << 20); time.sleep({hold})"


def serve_script(tmp_path, mib: int = 256, hold: float = 0.3) -> str:
    """A ./serve.sh whose python child makes ``mib`` MiB resident (the shell itself: ~0)."""
    script = tmp_path / "serve.sh"
    script.write_text(f'#!/bin/sh\n"{sys.executable}" -I -S -c "{ALLOCATE.format(mib=mib, hold=hold)}"\nexit $?\n')
    script.chmod(0o755)
    return str(script)


def guard_cli(*args: str) -> subprocess.CompletedProcess:
    """``hostmem guard ARGS`` as its own process, as a CI job runs it."""
    return subprocess.run(
        [sys.executable, "-m", "planners.cli", "guard", *args], capture_output=True, text=True, timeout=120
    )


def leftover_groups() -> list[str]:
    """Memory cgroups a guard that has ended left under this process's own (there must be
    none). A group is named after the guard's pid; one whose guard still runs belongs to
    a test running beside this one (another worker), not to a guard that ended, and so
    does one whose guard a test kills on purpose (:func:`killing_on_purpose`)."""
    found = memory_cgroup_dir()
    if found is None or not os.path.isdir(found[1]):
        return []
    names = [name for name in os.listdir(found[1]) if name.startswith("hostmem-guard-")]
    killed = set(os.listdir(_KILLED)) if os.path.isdir(_KILLED) else set()
    pids = {name: name.split("-")[2] for name in names}
    return [name for name, pid in pids.items() if not psutil.pid_exists(int(pid)) and pid not in killed]


_KILLED = os.path.join(tempfile.gettempdir(), "guards-killed-on-purpose")  # the run's, every worker's


def killing_on_purpose(pid: int) -> None:
    """Say, before it is killed with SIGKILL, that the guard ``pid`` leaves its group behind on
    purpose: a test's own until the next guard removes it, which :func:`leftover_groups`
    skips in every worker of the run (they share its temporary folder)."""
    os.makedirs(_KILLED, exist_ok=True)
    open(os.path.join(_KILLED, str(pid)), "w").close()


def test_the_script_s_child_is_counted_by_default_and_not_with_no_children(tmp_path):
    script = serve_script(tmp_path)
    done = guard_cli("--max-peak-anon", "128MiB", "--json", str(tmp_path / "tree.json"), "--", script)
    verdict = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 3, done.stderr
    assert verdict.startswith("hostmem guard: OVER LIMIT: peak anonymous ")
    how = "memory cgroup" if NO_CGROUP is None else "tree scan"
    assert f"processes, {how};" in verdict
    data = json.loads((tmp_path / "tree.json").read_text())
    assert data["children"] is True and data["counting"] == how
    assert data["processes"] >= 2 and data["peak_anon_bytes"] >= 250 * MiB
    alone = guard_cli("--max-peak-anon", "128MiB", "--no-children", "--", script)
    assert alone.returncode == 0, alone.stderr
    assert "within limit" in alone.stderr and "the command's own process only" in alone.stderr
    assert leftover_groups() == []


def test_children_is_still_accepted_and_means_the_default(tmp_path):
    done = guard_cli("--max-peak-anon", "128MiB", "--children", "--", serve_script(tmp_path, hold=0.1))
    assert done.returncode == 3, done.stderr


@pytest.mark.parametrize("counting", MODES)
def test_a_grandchild_is_counted_and_the_processes_are_named(counting, tmp_path):
    # sh (the command) -> sh -> python that allocates 256 MiB (a grandchild)
    inner = tmp_path / "inner.sh"
    # held 1.5 s: a tree scan sees a process only while it lives, and on a loaded machine
    # (a full suite on two cores) its thread may wait longer than 0.3 s for its turn
    inner.write_text(f"#!/bin/sh\nexec {serve_script(tmp_path, hold=1.5)}\n")
    inner.chmod(0o755)
    result = run_guarded(["sh", "-c", f"{inner}; exit $?"], 128 * MiB, counting=counting)
    assert (result.exceeded, result.guard_exit_code) == (True, 3)
    assert result.counting == {"cgroup": "memory cgroup", "tree": "tree scan"}[counting]
    assert result.figures.processes >= 2
    assert 250 * MiB <= result.figures.peak_bytes < 300 * MiB
    assert f"{result.figures.processes} processes, {result.counting};" in result.verdict()
    assert leftover_groups() == []


SHARED = textwrap.dedent(
    """
    import os, sys, time
    block = b"\\x01" * (128 << 20)        # 128 MiB, then shared copy-on-write with two children
    pids = [os.fork() for _ in range(1)]
    if pids[0] == 0:
        os.fork()                          # the parent and two children now all map the block
    time.sleep(0.5)
    """
)


@needs_cgroup
def test_the_cgroup_and_the_tree_scan_each_count_a_page_forks_share_once():
    """The block is written once and shared by the forks: the group charges it once, and the
    tree scan sums proportional shares (summed whole, each process's RssAnon held it)."""
    command = [sys.executable, "-I", "-S", "-c", SHARED]
    group = run_guarded(command, 1024 * MiB, counting="cgroup")
    tree = run_guarded(command, 1024 * MiB, counting="tree")
    assert group.figures.processes >= 3 and tree.figures.processes >= 3
    assert 120 * MiB <= group.figures.peak_bytes < 200 * MiB  # the block once
    assert 120 * MiB <= tree.figures.peak_bytes < 200 * MiB


DAEMON = textwrap.dedent(
    """
    import os, sys, time
    ready, release, pidfile = sys.argv[1:4]
    if os.fork() == 0:
        os.setsid()
        middle = os.getpid()
        if os.fork() != 0:
            os._exit(0)                            # the middle process exits: the daemon re-parents
        with open(pidfile, "w") as handle:
            handle.write(str(os.getpid()))
        while os.getppid() == middle:
            time.sleep(0.005)
        time.sleep(0.2)                            # allocate well after the re-parenting
        block = b"\\x01" * (256 << 20)
        open(ready, "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.01)
        os._exit(0)
    os.wait()                                      # the middle process
    while not os.path.exists(ready):
        time.sleep(0.01)
    time.sleep(0.05)
    """
)


@needs_cgroup
def test_a_daemon_that_re_parents_is_counted_in_the_cgroup_and_left_running(tmp_path):
    ready, release, pidfile = (str(tmp_path / name) for name in ("ready", "release", "daemon.pid"))
    try:
        result = run_guarded([sys.executable, "-I", "-S", "-c", DAEMON, ready, release, pidfile], 128 * MiB)
        daemon = int(open(pidfile).read())
        assert result.counting == "memory cgroup"
        assert (result.exceeded, result.guard_exit_code) == (True, 3)
        assert result.figures.peak_bytes >= 250 * MiB
        assert result.left_running == (daemon,)
        assert f"kept running: pid {daemon}" in result.verdict()
        assert os.getppid() != daemon and os.path.exists(f"/proc/{daemon}")  # not killed
        assert leftover_groups() == []
    finally:
        open(release, "w").close()
        if os.path.exists(pidfile):
            daemon = int(open(pidfile).read())
            wait_for(lambda: not _alive(daemon), f"daemon {daemon} ending once released")


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie no longer counts)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_counting_in_a_cgroup_where_none_can_be_made_is_an_error_that_says_why():
    if NO_CGROUP is None:
        pytest.skip("this machine can nest a memory cgroup: the error cannot arise here")
    with pytest.raises(ValueError, match="cannot count the command in a memory cgroup of its own"):
        run_guarded(["true"], MiB, counting="cgroup")


def test_the_guard_does_not_import_torch():
    code = textwrap.dedent(
        """
        import sys
        from planners.cli import main
        code = main(["guard", "--max-peak-anon", "64MiB", "--", "true"])
        print(code, "torch" in sys.modules)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["0", "False"], done.stderr
