"""The command line under hostile arguments: an answer or one line of refusal, never a traceback.

Generated argument lists for the light commands (plan, inspect, cache) run through
``planners.cli.main`` in this process; whatever they hold, main returns an exit code
(or argparse exits with its usage line). Any other exception is a bug the error root
lets through with its traceback, and fails here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planners import cli

REPO = Path(__file__).resolve().parent.parent.parent
_SETTINGS = settings(database=None, deadline=None, max_examples=150,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])
_WORDS = st.sampled_from(["", "0", "-1", "1e400", "nan", "8EiB", "12 parsecs", "ab" * 32, "..", "/", "/proc/self",
                          "/dev/null", "-", "--json", "\x00", "é"]) | st.text(max_size=8)


@pytest.fixture
def places(tmp_path):
    """Paths an argument may name: a config of random text, a folder, a file, nothing."""
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_bytes(b"\xff\xfe not yaml: [")
    shipped = sorted(str(p) for p in (REPO / "configs").glob("*.yaml"))
    return [str(tmp_path / "config.yaml"), str(tmp_path / "folder"), str(tmp_path / "file"),
            str(tmp_path / "missing"), *shipped]


def _argv(draw, places):
    command = draw(st.sampled_from(["plan", "inspect", "cache ls", "cache verify", "cache prune", "cache rm"]))
    argv = command.split()
    value = st.sampled_from(places) | st.sampled_from(["none", "in-place", "cached"]) | _WORDS
    options = {"plan": ["--json", "--what-if"], "inspect": ["--json", "--top", "--cgroup"],
               "cache": ["--root", "--json", "--max-size", "--all", "--dry-run"]}[argv[0]]
    for _ in range(draw(st.integers(0, 4))):
        argv += [draw(st.sampled_from(options)), draw(value)]
    if argv[0] == "plan" or command == "cache rm":
        argv.append(draw(value))
    return argv


@_SETTINGS
@given(data=st.data(), text=st.text(max_size=200))
def test_any_arguments_end_in_an_exit_code_not_a_traceback(data, text, places, capsys):
    with open(places[0], "w") as handle:
        handle.write(text)
    argv = _argv(data.draw, places)
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse: a usage line and exit 2
        code = exc.code
    captured = capsys.readouterr()
    assert isinstance(code, int), (argv, code)
    assert "Traceback" not in captured.err, (argv, captured.err)
    if code == 2 and captured.err:
        assert captured.err.startswith(("hostmem", "usage:")), (argv, captured.err)
    assert os.path.isdir(places[1])  # nothing named was removed
