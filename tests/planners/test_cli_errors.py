"""The command line on bad input: exit 2 and one line naming what, where and what to do.

Each case runs ``hostmem`` in a subprocess, as a person would, and checks the exit code
and the whole message; none may end in a traceback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from hostmem.procfs.stat import read_stat
from tests.conftest import write_safetensors
from tests.planners.conftest import write_checkpoint

MiB = 1024 * 1024


def hostmem(*argv, cwd=None, env=None) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "planners.cli", *argv], capture_output=True, text=True,
                         cwd=cwd, env=env, timeout=120)
    assert "Traceback" not in out.stderr, out.stderr
    return out


def config_with(tmp_path, body: str) -> str:
    path = tmp_path / "deploy.yaml"
    path.write_text(textwrap.dedent(body).lstrip())
    return str(path)


DECLARED = """
deployment: t
host: {limit: 32GiB, reserve: 4GiB}
workload: {steps: 4}
components:
  dit: {size: 8GiB, layers: 8, lora_targets: 4GiB, offload: layerwise}
"""


def test_version():
    out = hostmem("--version")
    assert out.returncode == 0 and out.stdout.startswith("hostmem 0.")


def test_a_pid_that_names_no_process():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    out = hostmem("inspect", "--pid", str(gone.pid))
    assert out.returncode == 2
    assert out.stderr == f"hostmem: error: pid {gone.pid}: no such process (it may have exited; list processes with `ps`)\n"


def test_a_zombie_and_a_kernel_thread_are_named_as_what_they_are():
    """Neither has user memory; before, the error named whichever /proc file failed first
    ('/proc/N/mountinfo: Invalid argument', '/proc/2/pagemap: No such process')."""
    child = os.fork()
    if child == 0:
        os._exit(0)
    try:
        while read_stat(child).state != "Z":
            time.sleep(0.01)
        out = hostmem("inspect", "--pid", str(child))
        assert out.returncode == 2
        assert out.stderr == (f"hostmem: error: pid {child}: has exited, and its parent has not reaped it yet "
                              "(a zombie): it holds no memory to measure\n")
    finally:
        os.waitpid(child, 0)
    kthreads = [p for p in os.listdir("/proc") if p.isdigit() and _kernel_thread(int(p))]
    if not kthreads:
        pytest.skip("no kernel thread visible in /proc here")
    out = hostmem("inspect", "--pid", kthreads[0])
    assert out.returncode == 2
    assert out.stderr == f"hostmem: error: pid {kthreads[0]}: a kernel thread: it has no user memory to measure\n"


def _kernel_thread(pid: int) -> bool:
    try:
        return read_stat(pid).kernel_thread
    except (OSError, IndexError):
        return False


def _refused(reader: list[str], pid: int) -> bool:
    """Whether ``reader`` (a command prefix) is refused /proc/PID/smaps here."""
    done = subprocess.run([*reader, "head", "-c", "1", f"/proc/{pid}/smaps"], capture_output=True, text=True)
    return done.returncode != 0 and "Permission denied" in done.stderr


def _uid(pid: int) -> int | None:
    with open(f"/proc/{pid}/status") as handle:
        return next((int(line.split()[1]) for line in handle if line.startswith("Uid:")), None)


def _says_what_refuses_root(out: subprocess.CompletedProcess, pid: int) -> str:
    assert out.returncode == 2 and out.stdout == ""
    (line,) = out.stderr.splitlines()
    assert line.startswith(f"hostmem: error: /proc/{pid}/")
    assert "permission denied (E" in line and ") although this runs as root: " in line  # the errno's name
    assert "as root)" not in line and "run as" not in line  # it is root already
    return line


@pytest.mark.skipif(os.geteuid() != 0, reason="what root is told; a user is told to run as root")
def test_inspect_as_root_of_a_process_root_may_not_read_says_what_refuses_it():
    """A sandbox's init (pid 1 of some VMs and containers) can refuse root its maps: "run as
    root" helps no one there; the line says what refuses it instead."""
    if not _refused([], 1):
        pytest.skip("root may read /proc/1/smaps here")
    line = _says_what_refuses_root(hostmem("inspect", "--pid", "1"), 1)
    assert "pid 1" in line and ("CAP_SYS_PTRACE" in line or "ptrace_scope" in line or "user namespace" in line)


@pytest.mark.skipif(os.geteuid() != 0, reason="what root is told; a user is told to run as root")
def test_inspect_as_root_without_cap_sys_ptrace_names_that_capability():
    """Root without CAP_SYS_PTRACE (a container's, usually) may not read another user's maps."""
    import shutil

    if not shutil.which("setpriv"):
        pytest.skip("needs setpriv")
    target = subprocess.Popen(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "sleep", "60"])
    try:
        while _uid(target.pid) != 65534 and target.poll() is None:  # until setpriv has taken the other user
            time.sleep(0.01)
        reader = ["setpriv", "--bounding-set", "-sys_ptrace", "--"]
        if not _refused(reader, target.pid):
            pytest.skip("this kernel lets root without CAP_SYS_PTRACE read another user's maps")
        out = subprocess.run([*reader, sys.executable, "-m", "planners.cli", "inspect", "--pid", str(target.pid)],
                             capture_output=True, text=True, timeout=120)
        assert "lacks CAP_SYS_PTRACE" in _says_what_refuses_root(out, target.pid)
    finally:
        target.kill()
        target.wait()


def test_a_missing_adapter_is_named_by_key_and_line(tmp_path):
    write_checkpoint(tmp_path / "dit", layers=2, layer_bytes=MiB)
    path = config_with(tmp_path, """
        deployment: t
        host: {limit: 32GiB, reserve: 4GiB}
        workload: {steps: 4}
        components:
          dit: {path: dit, layers: "blocks.{i}.", offload: layerwise}
        lora:
          adapters:
            - {path: loras/typo.safetensors, strength: 1.0}
        """)
    out = hostmem("plan", path)
    assert out.returncode == 2
    assert out.stderr.startswith(f"hostmem: error: {path}:8: lora.adapters[0].path: ")
    assert "loras/typo.safetensors: no such adapter file; fix the path" in out.stderr


def test_declared_sizes_plan_without_the_adapter_file(tmp_path):
    """A what-if for a host one does not have reads no file, so a missing adapter is fine."""
    path = config_with(tmp_path, DECLARED + "lora:\n  adapters: [{path: elsewhere.safetensors}]\n")
    assert hostmem("plan", path).returncode == 0


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("limit", "'1.5'", "host.limit: not a size: '1.5' (a fraction of a byte: add a unit"),
        ("limit", ".inf", "host.limit: not a size: inf (not a finite number"),
        ("limit", "9" * 400, "host.limit: not a size: 999999999999999999999999999999...(400 characters)"),
        ("reserve", "'1e400'", "host.reserve: not a size: '1e400'"),
    ],
)
def test_sizes_in_a_config_name_their_key_and_line(tmp_path, field, value, words):
    body = DECLARED.replace("limit: 32GiB, reserve: 4GiB", {"limit": f"limit: {value}, reserve: 4GiB",
                                                              "reserve": f"limit: 32GiB, reserve: {value}"}[field])
    path = config_with(tmp_path, body)
    out = hostmem("plan", path)
    assert out.returncode == 2 and out.stderr.startswith(f"hostmem: error: {path}:2: {words}"), out.stderr


def test_nan_strength_alias_and_huge_counts(tmp_path):
    nan = config_with(tmp_path, DECLARED + "lora:\n  adapters: [{path: a.safetensors, strength: .nan}]\n")
    out = hostmem("plan", nan)
    assert out.returncode == 2
    assert out.stderr == f"hostmem: error: {nan}:7: lora.adapters[0].strength: nan is not a finite number\n"
    alias = config_with(tmp_path, "deployment: &a [*a]\n")
    out = hostmem("plan", alias)
    assert out.returncode == 2 and out.stderr.startswith(f"hostmem: error: {alias}:1: alias *a is not accepted")
    steps = config_with(tmp_path, DECLARED.replace("steps: 4", "steps: " + "9" * 400))
    out = hostmem("plan", steps)
    assert out.returncode == 2 and "workload.steps: 999999999999999999999999999999...(400 characters) is not a " \
        "whole number from 1 to 10,000" in out.stderr


@pytest.mark.parametrize(
    "argv, option",
    [
        (("demo", "--scale", "abc"), "--scale"),
        (("demo", "--host-limit", "1.5"), "--host-limit"),
        (("cache", "prune", "--max-size", "abc"), "--max-size"),
        (("guard", "--max-peak-anon", "1.5", "--", "true"), "--max-peak-anon"),
        (("guard", "--max-peak-anon", "-1MiB", "--", "true"), "--max-peak-anon"),  # read as an option by argparse
        (("cache", "prune", "--max-size", "-1GiB"), "--max-size"),
    ],
)
def test_a_bad_size_option_is_named(argv, option):
    out = hostmem(*argv)
    assert out.returncode == 2
    assert option in out.stderr and "not a size" in out.stderr, out.stderr


def test_ctrl_c_in_the_demo_exits_130_with_one_line(tmp_path):
    """SIGINT to the whole process group, as a terminal sends it, once a scenario runs."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    demo = subprocess.Popen([sys.executable, "-m", "planners.cli", "demo", "--scale", "8MiB"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen = []
    for line in demo.stderr:
        seen.append(line)
        if line.startswith("scenario "):
            break
    os.killpg(demo.pid, signal.SIGINT)
    rest = demo.stderr.read()
    assert demo.wait(timeout=60) == 130, "".join(seen) + rest
    assert rest.strip().splitlines()[-1] == (
        "hostmem demo: interrupted; its temporary files were removed; run the same command again to start over"
    )
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest
    assert not [p for p in os.listdir(tmp_path) if p.startswith("hostmem-demo-")]


def test_an_adapter_with_a_corrupt_header_is_the_projects_error(tmp_path):
    write_checkpoint(tmp_path / "dit", layers=2, layer_bytes=MiB, cols=256)
    adapter = write_safetensors(tmp_path / "a.safetensors", {"x.lora_down.weight": torch.ones(4, 256)})
    raw = bytearray(open(adapter, "rb").read())
    start = raw.index(b'"data_offsets":[') + len(b'"data_offsets":[')
    raw[start:start + 1] = b"9"  # the offsets now leave a gap at the front
    open(adapter, "wb").write(bytes(raw))
    path = config_with(tmp_path, """
        deployment: t
        host: {limit: 32GiB, reserve: 4GiB}
        workload: {steps: 4}
        components:
          dit: {path: dit, layers: "blocks.{i}.", offload: layerwise}
        lora: {adapters: [{path: a.safetensors}]}
        """)
    out = hostmem("plan", path)
    assert out.returncode == 2 and out.stderr.startswith("hostmem: error: ")
    assert f"{adapter}: tensor 'x.lora_down.weight' spans bytes 9..4096" in out.stderr


def test_a_nul_byte_in_an_argument_is_one_line_not_a_traceback(capsys):
    from planners import cli
    from planners.config import ConfigError, load_config

    assert cli.main(["plan", "\x00"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hostmem: error: argument 2") and "NUL byte" in err and "Traceback" not in err
    with pytest.raises(ConfigError, match="NUL byte"):
        load_config("configs/\x00.yaml")


def test_a_guarded_commands_own_negative_arguments_reach_it_as_given():
    """Without ``--``, the guarded command begins at its first word: its own ``--interval -1``
    is never joined into ``--interval=-1`` as a negative value of the guard's options is."""
    out = hostmem("guard", "--max-peak-anon", "1GiB", sys.executable, "-c", "import sys; print(sys.argv[1:])",
                  "--interval", "-1", "--json", "-3")
    assert out.returncode == 0, out.stderr
    assert "['--interval', '-1', '--json', '-3']" in out.stdout, out.stdout
