"""Running the fenced examples of a markdown page, with sybil.

sybil (a maintained tool for testing documentation examples) parses the page and keeps
what it knows: ```python blocks are run in one namespace per page (a block of ``>>>``
lines is a doctest, its printed output compared), and ``<!-- skip: next -->`` leaves the
next block out. The project adds evaluators for what only it can check: ```sh blocks of
its own command (``hostmem ...``, run in a shell; a ``$ `` line followed by the output
it prints is compared with doctest's ELLIPSIS, and ``(exit N)`` names a code other than
0), ```yaml blocks of a deployment (loaded by the config parser) and ```json blocks
(parsed). ```text blocks are synopses and printed output: shown, not run. Any other
fence, or one without a language, is an error, so no example escapes unnoticed.
"""

from __future__ import annotations

import doctest
import json
import re
import subprocess
from pathlib import Path

from sybil import Sybil
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser

RUN, SHOWN = {"python", "sh", "yaml", "json"}, {"text"}
_FENCE = re.compile(r"^(`{3,}|~{3,})(.*)$")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=\S*$")
_EXIT = re.compile(r"^\(exit (\d+)\)$")
_CHECKER = doctest.OutputChecker()
_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def unknown_fences(text: str) -> list[str]:
    """``line N: ...`` for every opening fence whose language is neither run nor shown."""
    out, inside = [], None
    for number, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line)
        if not match:
            continue
        if inside is not None:
            if match.group(1).startswith(inside) and not match.group(2).strip():
                inside = None
            continue
        inside = match.group(1)
        language = match.group(2).strip().split(" ")[0]
        if language not in RUN | SHOWN:
            out.append(f"line {number}: a fenced block {'without a language' if not language else repr(language)}: "
                       f"label it python, sh, yaml or json (run) or text (shown only)")
    return out


def _commands(source: str) -> list[tuple[str, list[str]]]:
    """``(command, expected output lines)`` of a sh block.

    A block with ``$ `` lines is a transcript: each ``$ `` line a command, the lines after
    it what it prints. Otherwise every line but blanks and ``#`` comments is a command.
    """
    lines = [line for line in source.splitlines() if line.strip()]
    if not any(line.startswith("$ ") for line in lines):
        return [(line, []) for line in lines if not line.lstrip().startswith("#")]
    out: list[tuple[str, list[str]]] = []
    for line in lines:
        if line.startswith("$ "):
            out.append((line[2:], []))
        elif out:
            out[-1][1].append(line)
    return out


def _is_own_command(command: str) -> bool:
    words = command.split()
    while words and _ASSIGNMENT.match(words[0]):
        words.pop(0)
    return bool(words) and words[0] == "hostmem"


def run_shell(example) -> str | None:
    """Run each ``hostmem`` line of a sh block; a failure message, or None."""
    for command, expected in _commands(example.parsed):
        if not _is_own_command(command):
            return (f"{command!r} is not a hostmem command: mark the block <!-- skip: next --> "
                    f"and say why in the sentence before it")
        code = 0
        if expected and _EXIT.match(expected[-1].strip()):
            code = int(_EXIT.match(expected[-1].strip()).group(1))
            expected = expected[:-1]
        run = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300)
        output = run.stdout + run.stderr
        if run.returncode != code:
            return f"{command!r} exited {run.returncode}, expected {code}:\n{output[-3000:]}"
        want = "\n".join(expected) + "\n" if expected else ""
        if want and not _CHECKER.check_output(want, output, _FLAGS):
            return f"{command!r} printed\n{output}\nexpected\n{want}"
    return None


def check_yaml(example) -> str | None:
    """A deployment config must load (declared sizes, or files the page's folder holds)."""
    from planners.config import load_config

    path = Path(f"_example_line{example.line}.yaml")
    path.write_text(example.parsed)
    try:
        load_config(str(path), environ={})
    except Exception as exc:  # the message is the failure the page must not show
        return f"the config does not load: {exc}"
    finally:
        path.unlink()
    return None


def check_json(example) -> str | None:
    try:
        json.loads(example.parsed)
    except ValueError as exc:
        return f"not JSON: {exc}"
    return None


SYBIL = Sybil(parsers=[
    PythonCodeBlockParser(),
    CodeBlockParser("sh", run_shell),
    CodeBlockParser("yaml", check_yaml),
    CodeBlockParser("json", check_json),
    SkipParser(),
])


def run_page(page: Path) -> None:
    """Every example of ``page`` in order, in the current folder; AssertionError at the first failure."""
    problems = unknown_fences(page.read_text())
    assert not problems, f"{page}:\n" + "\n".join(problems)
    document = SYBIL.parse(page)
    for example in document.examples():
        try:
            example.evaluate()
        except AssertionError:
            raise
        except Exception as exc:
            raise AssertionError(f"{page}, line {example.line}: {type(exc).__name__}: {exc}") from exc
