"""The error root: a project error is one line on the command line, a bug keeps its traceback."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

import hostmem
from hostmem.errors import HostmemError, InputError
from planners import cli
from planners.config import ConfigError


def test_project_errors_keep_the_builtin_they_replace():
    from hostmem.procfs import ProcReadError

    assert issubclass(ConfigError, HostmemError) and issubclass(ConfigError, ValueError)
    assert issubclass(ProcReadError, HostmemError) and issubclass(ProcReadError, OSError)
    assert hostmem.HostmemError is HostmemError
    with pytest.raises(ValueError, match="not a size"):
        hostmem.parse_size("twelve")
    with pytest.raises(InputError):
        hostmem.parse_size("twelve")


def _run_raising(monkeypatch, capsys, exc: BaseException) -> int:
    """``cli.main`` with a command whose run raises ``exc``."""

    def parser(argv):
        p = argparse.ArgumentParser(prog="hostmem")
        p.set_defaults(run=lambda args: (_ for _ in ()).throw(exc))
        return p

    monkeypatch.setattr(cli, "build_parser", parser)
    return cli.main([])


def test_a_project_error_is_one_line_and_exit_2(monkeypatch, capsys):
    code = _run_raising(monkeypatch, capsys, ConfigError("deploy.yaml:3", "host.limit", "not a size; give e.g. 32GiB"))
    err = capsys.readouterr().err
    assert code == 2
    assert err == "hostmem: error: deploy.yaml:3: host.limit: not a size; give e.g. 32GiB\n"


def test_a_librarys_warning_is_one_line_of_the_commands(monkeypatch, capsys):
    """Python's own form is two lines: the warning's file and line, then its source line."""
    import warnings

    def parser(argv):
        p = argparse.ArgumentParser(prog="hostmem")
        p.set_defaults(run=lambda args: warnings.warn("the cache root is on tmpfs", UserWarning) or 0)
        return p

    monkeypatch.setattr(cli, "build_parser", parser)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert cli.main([]) == 0
    assert capsys.readouterr().err == "hostmem: warning: the cache root is on tmpfs\n"


def test_a_bug_keeps_its_traceback(monkeypatch, capsys):
    with pytest.raises(ValueError, match="a bug"):
        _run_raising(monkeypatch, capsys, ValueError("a bug"))
    with pytest.raises(TypeError):
        _run_raising(monkeypatch, capsys, TypeError("unhashable type: 'list'"))


def test_a_bad_size_on_the_command_line_is_one_line():
    done = subprocess.run(
        [sys.executable, "-m", "planners.cli", "guard", "--max-peak-anon", "twelve", "--", "true"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("hostmem") and "twelve" in done.stderr

