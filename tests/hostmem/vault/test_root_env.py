"""``HOSTMEM_CACHE_ROOT`` empty or relative is refused, never resolved against whichever
folder a process happens to start in (a build and a server started from two folders
would use two roots, and the server would build again)."""

from __future__ import annotations

import os
import subprocess

import pytest

import lora_cache
from lora_cache.placement.layers import checkpoint_module
from tests.conftest import run_python
from tests.fresh_fork import CLI, TORCH
from tests.hostmem.vault.test_vault_cli import cli_with_env
from tests.lora_cache.test_orchestrate import _config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
ODD = ["relative/x", "", " ", "-", "--root", "/proc/self/cwd/x"]


def _refused(done) -> None:
    """One line on stderr, exit 2, naming the variable and what to give."""
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("hostmem: error: HOSTMEM_CACHE_ROOT") and "give an absolute path" in line, line


@pytest.mark.parametrize("value", ODD, ids=["relative", "empty", "blank", "dash", "option", "through-proc"])
def test_the_cache_commands_refuse_a_relative_or_empty_root_variable_in_one_line(tmp_path, value):
    for command in (["cache", "ls"], ["cache", "verify"], ["calibrate", "--size", "8MiB"]):
        _refused(subprocess_in(tmp_path, value, *command))
    assert os.listdir(tmp_path) == []  # nothing made where the process stood


def test_lora_merge_and_a_start_refuse_a_relative_root_variable(tmp_path, monkeypatch):
    config = _config(tmp_path)
    with open(config) as handle:
        text = handle.read().replace("root: cache, ", "")
    with open(config, "w") as handle:
        handle.write(text)
    before = sorted(os.listdir(tmp_path))
    _refused(subprocess_in(tmp_path, "relative/x", "lora", "merge", config))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOSTMEM_CACHE_ROOT", "relative/x")
    model = checkpoint_module([str(tmp_path / "dit.safetensors")])
    with pytest.raises(ValueError, match=r"HOSTMEM_CACHE_ROOT='relative/x' is a relative path.*give an absolute path"):
        lora_cache.merge(model, [(tmp_path / "a.safetensors", 0.8)], progress=False)
    assert sorted(os.listdir(tmp_path)) == before


def test_an_absolute_root_variable_and_a_tilde_are_taken(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    for value in (str(tmp_path / "root"), "~/root"):
        done = cli_with_env({"HOSTMEM_CACHE_ROOT": value, "HOME": str(home)}, "cache", "ls")
        assert done.returncode == 0 and done.stdout.startswith("nothing cached yet under"), done.stderr


def subprocess_in(folder, value: str, *argv) -> subprocess.CompletedProcess:
    """``hostmem *argv`` in a fresh process started in ``folder``, the variable set to ``value``."""
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "HOSTMEM_CACHE_ROOT": value, "PYTHONPATH": path}
    return run_python(CLI, *argv, env=env, cwd=folder, timeout=120, forked_from=TORCH)
