"""A child forked from the preloaded server ends as a new interpreter would, on the same
code: its output, its exit status, its folder and environment, its threads and atexit."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.conftest import run_python
from tests.fresh_fork import TORCH

CHILD = """
import atexit, os, sys, threading, time
print("argv", sys.argv[1:], os.getcwd(), os.environ.get("HOSTMEM_TEST_WORD"))
print("to stderr", file=sys.stderr)
atexit.register(lambda: print("atexit ran"))
threading.Thread(target=lambda: (time.sleep(0.1), print("thread ran"))).start()
how = sys.argv[1]
if how == "exit 3":
    sys.exit(3)
if how == "exit with a message":
    sys.exit("refused")
if how == "raise":
    raise ValueError("boom")
if how == "interrupted":
    raise KeyboardInterrupt
if how == "killed":
    sys.stdout.flush()
    os.kill(os.getpid(), 9)
"""


@pytest.mark.parametrize("how", ["ok", "exit 3", "exit with a message", "raise", "interrupted", "killed"])
def test_a_forked_child_ends_as_a_new_interpreter_does(how, tmp_path):
    env = {**os.environ, "HOSTMEM_TEST_WORD": "word"}
    new, forked = (run_python(CHILD, how, cwd=tmp_path, env=env, forked_from=f) for f in (None, TORCH))
    assert (forked.returncode, forked.stdout) == (new.returncode, new.stdout)
    assert forked.stderr.splitlines()[-1] == new.stderr.splitlines()[-1]
    assert f"argv ['{how}'] {tmp_path} word" in forked.stdout


def test_a_forked_child_past_its_timeout_is_killed_and_its_output_kept():
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        run_python("import time; print('started', flush=True); time.sleep(60)", timeout=2, forked_from=TORCH)
    assert raised.value.output == "started\n"
    assert run_python("print('next')", forked_from=TORCH).stdout == "next\n"  # the server goes on
