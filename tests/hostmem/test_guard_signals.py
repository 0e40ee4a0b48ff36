"""Interrupting ``hostmem guard`` and the peak tracker: real signals to real processes.

A SIGINT or SIGTERM sent to the guard reaches every process of its command, the guard
exits 128 + N (130 for Ctrl-C) with one line saying what happened and what was cleaned
up, and the memory cgroup is gone. A Ctrl-C typed at a terminal (a pseudo-terminal
here) reaches the command once, not twice. The sampler outlives a Ctrl-C that reaches
its process group, so a tracker never reports "peak sampler has exited".
"""

from __future__ import annotations

import fcntl
import os
import pty
import signal
import subprocess
import sys
import termios
import textwrap
import time

import psutil
import pytest

from tests.hostmem.test_guard_tree import MODES, killing_on_purpose, leftover_groups, needs_cgroup
from tests.hostmem.test_peak import process_state, wait_for

# The command: a shell script whose python child writes each signal it gets into a
# file, waiting 0.3 s after the first (so a doubled signal shows in the file). The
# shell itself ends by the signal, as it does at a terminal.
CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    log, ready = sys.argv[1], sys.argv[2]
    got = []
    def note(signum, frame):
        got.append(signum)
        with open(log, "a") as handle:
            handle.write(signal.Signals(signum).name + "\\n")
    signal.signal(signal.SIGINT, note)
    signal.signal(signal.SIGTERM, note)
    block = b"\\x01" * (64 << 20)
    open(ready, "w").close()
    deadline = time.monotonic() + 60
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)                         # room for a second, doubled signal to arrive
    sys.exit(10)
    """
)

# Drives run_guarded with a chosen way of counting, as the command line would.
DRIVER = textwrap.dedent(
    """
    import sys
    from hostmem.guard import run_guarded
    result = run_guarded(sys.argv[3:], 512 << 20, counting=sys.argv[1], grace_s=float(sys.argv[2]))
    print(result.interruption() if result.interrupted else result.verdict(), file=sys.stderr)
    sys.exit(result.guard_exit_code)
    """
)


def command(tmp_path) -> list[str]:
    (tmp_path / "child.py").write_text(CHILD)
    script = tmp_path / "serve.sh"
    script.write_text(f'#!/bin/sh\n"{sys.executable}" "{tmp_path / "child.py"}" "$1" "$2"\nexit $?\n')
    script.chmod(0o755)
    return [str(script), str(tmp_path / "signals.log"), str(tmp_path / "ready")]


def start_guard(tmp_path, counting: str | None, **popen) -> subprocess.Popen:
    """The guard as its own process: the command line (``counting=None``) or the driver."""
    if counting is None:
        head = [sys.executable, "-m", "planners.cli", "guard", "--max-peak-anon", "512MiB", "--"]
    else:
        head = [sys.executable, "-c", DRIVER, counting, "10"]
    popen.setdefault("stderr", subprocess.PIPE)
    guard = subprocess.Popen([*head, *command(tmp_path)], text=True, **popen)
    wait_for(lambda: (tmp_path / "ready").exists() or guard.poll() is not None, "the command's child ready")
    return guard


def signals_seen(tmp_path) -> list[str]:
    log = tmp_path / "signals.log"
    return log.read_text().split() if log.exists() else []


def assert_one_clean_line(err: str, name: str, command_may_complain: bool = False) -> str:
    """The guard's last line reports the interruption; nothing of its own went wrong.

    ``command_may_complain``: the command may print its own traceback (a Python
    interrupted while it starts does), but none from the guard's code.
    """
    assert "peak sampler" not in err, err
    if command_may_complain:
        frames = [line for line in err.splitlines() if line.lstrip().startswith("File ")]
        assert not [line for line in frames if "/hostmem/" in line or "/planners/" in line], err
    else:
        assert "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"hostmem guard: interrupted by {name}: the command (pid "), err
    assert "cleaned up: the sampler" in line and "run the guard again for a verdict" in line
    return line


def test_sigint_to_the_guard_reaches_the_command_and_exits_130(tmp_path):
    guard = start_guard(tmp_path, None)
    guard.send_signal(signal.SIGINT)
    err = guard.communicate(timeout=60)[1]
    assert guard.returncode == 130, err
    line = assert_one_clean_line(err, "SIGINT")
    assert "was killed by signal 2 (passed SIGINT on to it)" in line
    assert signals_seen(tmp_path) == ["SIGINT"]  # the command's child got it, once
    assert "peak anonymous so far " in line and "of the 512.0 MiB limit" in line
    assert leftover_groups() == []


def test_sigterm_to_the_guard_s_whole_process_group_still_gives_the_one_line(tmp_path):
    # what a CI runner does when it cancels a job: every process of the group, sampler too
    guard = start_guard(tmp_path, None, start_new_session=True)
    os.killpg(guard.pid, signal.SIGTERM)
    err = guard.communicate(timeout=60)[1]
    assert guard.returncode == 128 + signal.SIGTERM, err
    assert_one_clean_line(err, "SIGTERM")
    assert "SIGTERM" in signals_seen(tmp_path)
    assert leftover_groups() == []


def test_sigint_while_the_guard_starts_its_command_still_gives_the_one_line(tmp_path):
    head = [sys.executable, "-m", "planners.cli", "guard", "--max-peak-anon", "512MiB", "--"]
    guard = subprocess.Popen([*head, *command(tmp_path)], stderr=subprocess.PIPE, text=True)
    wait_for(lambda: any("peak/sampler_program" in " ".join(p.cmdline()) for p in psutil.Process(guard.pid).children()),
             "the guard's sampler started", step_s=0.001)
    guard.send_signal(signal.SIGINT)  # the command is being started, or about to be
    err = guard.communicate(timeout=60)[1]
    assert guard.returncode == 130, err
    assert_one_clean_line(err, "SIGINT", command_may_complain=True)
    assert leftover_groups() == []
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]


@pytest.mark.parametrize("counting", MODES)
def test_sigterm_reaches_the_command_in_either_way_of_counting(counting, tmp_path):
    guard = start_guard(tmp_path, counting)
    guard.send_signal(signal.SIGTERM)
    err = guard.communicate(timeout=60)[1]
    assert guard.returncode == 128 + signal.SIGTERM, err
    line = assert_one_clean_line(err, "SIGTERM")
    assert "was killed by signal 15 (passed SIGTERM on to it)" in line
    assert ("memory cgroup" in line) == (counting == "cgroup")
    assert signals_seen(tmp_path) == ["SIGTERM"]
    assert leftover_groups() == []


IGNORES_SIGINT = (
    "import signal, sys, time; signal.signal(signal.SIGINT, signal.SIG_IGN); open(sys.argv[1], 'w').close(); "
    "time.sleep(60)"
)


def start_ignoring(tmp_path, counting: str, grace_s: float) -> subprocess.Popen:
    """A guard whose command (a shell and its python child) ignores SIGINT."""
    ready = tmp_path / "ready"
    command = ["sh", "-c", '"$0" -c "$1" "$2"', sys.executable, IGNORES_SIGINT, str(ready)]
    guard = subprocess.Popen(
        [sys.executable, "-c", DRIVER, counting, str(grace_s), *command], stderr=subprocess.PIPE, text=True
    )
    wait_for(ready.exists, "the command's python child ignoring SIGINT")
    return guard


@pytest.mark.parametrize("counting", MODES)
def test_a_command_that_ignores_sigint_is_killed_after_the_grace_period(counting, tmp_path):
    guard = start_ignoring(tmp_path, counting, grace_s=1.0)
    guard.send_signal(signal.SIGINT)
    err = guard.communicate(timeout=60)[1]
    assert guard.returncode == 130, err
    line = assert_one_clean_line(err, "SIGINT")
    assert "was killed by signal 9 (it had not ended 1 s after SIGINT, so it and all it started were killed)" in line
    assert leftover_groups() == []


@pytest.mark.parametrize("counting", MODES)
def test_a_second_sigint_kills_a_command_that_ignores_the_first(counting, tmp_path):
    guard = start_ignoring(tmp_path, counting, grace_s=10.0)
    guard.send_signal(signal.SIGINT)
    time.sleep(0.3)
    assert guard.poll() is None  # still waiting for the command, within its grace period
    started = time.monotonic()
    guard.send_signal(signal.SIGINT)
    err = guard.communicate(timeout=60)[1]
    assert time.monotonic() - started < 5  # not the 10 s grace: the second signal ends it
    assert guard.returncode == 130, err
    line = assert_one_clean_line(err, "SIGINT")
    assert "was killed by signal 9 (a second signal came before it ended, so it and all it started were killed)" in line
    assert leftover_groups() == []


def test_ctrl_c_at_a_terminal_reaches_the_command_once(tmp_path):
    master, slave = pty.openpty()

    def take_the_terminal():  # a new session whose controlling terminal is the pty
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    try:
        guard = start_guard(
            tmp_path, None, stdin=slave, stdout=slave, stderr=subprocess.PIPE, preexec_fn=take_the_terminal
        )
        time.sleep(0.2)
        os.write(master, b"\x03")  # Ctrl-C: the terminal sends SIGINT to its foreground group
        err = guard.communicate(timeout=60)[1]
    finally:
        os.close(master)
        os.close(slave)
    assert guard.returncode == 130, err
    line = assert_one_clean_line(err, "SIGINT")
    assert "was killed by signal 2 (it got SIGINT from the terminal too)" in line
    assert signals_seen(tmp_path) == ["SIGINT"]  # once, not once from the terminal and once from the guard


TRACKED = textwrap.dedent(
    """
    import os, sys, time
    from hostmem.peak import track_peak_anon
    with track_peak_anon(children=True) as peak:
        print(peak.sampler_pid, flush=True)
        time.sleep(60)
    """
)


def test_ctrl_c_to_a_tracked_process_and_its_sampler_leaves_no_sampler_error():
    # its own process group, signalled as a whole: what a Ctrl-C at a terminal does
    child = subprocess.Popen(
        [sys.executable, "-c", TRACKED], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    sampler = int(child.stdout.readline())
    os.killpg(child.pid, signal.SIGINT)
    err = child.communicate(timeout=60)[1]
    assert child.returncode == -signal.SIGINT  # Python's own ending on an unhandled Ctrl-C
    assert err.strip().splitlines()[-1] == "KeyboardInterrupt"
    assert "peak sampler" not in err and "PeakTrackerError" not in err
    wait_for(lambda: process_state(sampler) in (None, "Z"), f"sampler {sampler} ended with its tracker")


@needs_cgroup  # only the cgroup says what was left running
def test_what_the_command_started_ends_on_the_signal_passed_on_and_is_not_called_left_running(tmp_path):
    """The shell ends at once on SIGTERM; its python child takes 0.3 s. The guard waits
    for the child to end (it got the signal too) before naming anything "kept running"."""
    (tmp_path / "child.py").write_text(CHILD)
    ready = tmp_path / "ready"
    command = ["sh", "-c", '"$0" "$1" "$2" "$3" & wait', sys.executable, str(tmp_path / "child.py"),
               str(tmp_path / "signals.log"), str(ready)]
    guard = subprocess.Popen([sys.executable, "-c", DRIVER, "cgroup", "10", *command], stderr=subprocess.PIPE,
                             text=True)
    wait_for(lambda: ready.exists() or guard.poll() is not None, "the command's child ready")
    guard.send_signal(signal.SIGTERM)
    err = guard.communicate(timeout=60)[1]
    assert guard.returncode == 128 + signal.SIGTERM, err
    assert "kept running" not in assert_one_clean_line(err, "SIGTERM"), err
    assert signals_seen(tmp_path) == ["SIGTERM"]
    assert leftover_groups() == []


@pytest.mark.parametrize("signum", [signal.SIGQUIT, signal.SIGUSR1], ids=["SIGQUIT", "SIGUSR1"])
def test_ctrl_backslash_or_a_user_signal_to_the_guard_reaches_the_command_and_leaves_no_group(tmp_path, signum):
    """Left to their default action, these ended the guard at once: its command ran on, and
    its memory cgroup stayed behind."""
    guard = start_guard(tmp_path, None)
    guard.send_signal(signum)
    err = guard.communicate(timeout=60)[1]
    assert guard.returncode == 128 + signum, err
    line = assert_one_clean_line(err, signal.Signals(signum).name)
    assert f"passed {signal.Signals(signum).name} on to it" in line
    assert leftover_groups() == []
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]


@needs_cgroup
def test_a_group_left_by_a_guard_killed_with_sigkill_is_removed_by_the_next_guard(tmp_path):
    guard = start_guard(tmp_path, None)
    killing_on_purpose(guard.pid)
    os.kill(guard.pid, signal.SIGKILL)  # a CI runner's timeout: no clean-up can run
    guard.wait(timeout=60)
    for child in psutil.process_iter(["cmdline"]):  # its command, left running: end it as the runner would
        if str(tmp_path) in " ".join(child.info["cmdline"] or []):
            child.kill()
    wait_for(lambda: not [p for p in psutil.process_iter(["cmdline"])
                          if str(tmp_path) in " ".join(p.info["cmdline"] or [])], "the killed guard's command gone")
    from hostmem.procfs import memory_cgroup_dir

    (left,) = [name for name in os.listdir(memory_cgroup_dir()[1]) if name.startswith(f"hostmem-guard-{guard.pid}-")]
    folder = os.path.join(memory_cgroup_dir()[1], left)
    young = subprocess.run([sys.executable, "-m", "planners.cli", "guard", "--max-peak-anon", "512MiB", "--", "true"],
                           capture_output=True, text=True, timeout=60)
    assert young.returncode == 0 and os.path.isdir(folder)  # a minute old at most: its maker may be joining it
    os.utime(folder, (time.time() - 3600, time.time() - 3600))  # an hour ago, as a runner's timeout left it
    done = subprocess.run([sys.executable, "-m", "planners.cli", "guard", "--max-peak-anon", "512MiB", "--", "true"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not os.path.isdir(folder)  # the killed guard's group, removed by the next guard
    assert leftover_groups() == []


def test_a_signal_the_guard_was_started_to_ignore_is_ignored_and_its_command_runs_to_its_end(tmp_path):
    """``nohup hostmem guard -- CMD`` (or a background job's Ctrl-\\): the guard and its command
    start with the signal ignored. The guard used to take it as an interruption, pass it on to
    a command that ignored it too, and kill that command 10 s later."""
    done = tmp_path / "done"
    script = ("import pathlib, sys, time; pathlib.Path(sys.argv[1]).touch(); time.sleep(1.5); "
              "pathlib.Path(sys.argv[2]).touch()")
    guard = subprocess.Popen(
        [sys.executable, "-m", "planners.cli", "guard", "--max-peak-anon", "512MiB", "--",
         sys.executable, "-c", script, str(tmp_path / "ready"), str(done)],
        stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN),  # as nohup starts it
    )
    wait_for(lambda: (tmp_path / "ready").exists() or guard.poll() is not None, "the command ready")
    guard.send_signal(signal.SIGHUP)
    err = guard.communicate(timeout=60)[1]
    assert guard.returncode == 0, err
    assert "interrupted" not in err and "Traceback" not in err, err
    assert done.exists()  # the command ran to its end
