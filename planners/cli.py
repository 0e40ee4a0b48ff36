"""The ``hostmem`` command line.

Each sub-command lives in its own module under ``planners.commands`` with a
``register(subparsers)`` that adds its parser and sets ``run``; ``run(args)``
returns the exit code. Errors a person can act on are printed as one line
``hostmem: error: ...`` with exit code 2, never as a traceback. The project's
errors derive from :class:`hostmem.errors.HostmemError` (torch-free): one of them is
a refusal a person can act on and is printed that way; any other exception is a
bug and keeps its traceback, so that it can be found. An OSError is the system
refusing (a file named on the command line, a cgroup it cannot create): one line too.

Nothing here imports torch or the command modules' dependencies: a command imports
what it needs when it runs, so ``inspect``, ``plan``, ``guard`` and ``cache`` start in
a few tens of milliseconds (bench/bench_cli.py measures it).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import warnings

from hostmem.errors import HostmemError

COMMANDS = ("inspect", "plan", "guard", "lora", "cache", "demo", "calibrate")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser, with only the sub-command ``argv`` names when it starts with one.

    Registering a command imports its module and builds its parsers; doing that for
    all six costs more than the rest of a light command's start, and parses the same.
    Anything else (``--help``, ``--version``, a typo) gets every command.
    """
    parser = _Parser(
        prog="hostmem",
        description="Host-memory accounting and offload planning for diffusion-model serving.",
    )
    parser.add_argument("--version", action=_VersionAction, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    named = argv[0] if argv and argv[0] in COMMANDS else None
    for name in (named,) if named else COMMANDS:
        importlib.import_module(f"planners.commands.{name}").register(sub)
    return parser


def _terminal_columns() -> int:
    """``shutil.get_terminal_size().columns``, without importing shutil.

    argparse builds a help formatter for every argument it adds, and its default asks
    shutil for the width: importing shutil (and the compression modules it imports)
    is a tenth of a light command's start, for help text that is rarely printed.
    """
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or 80


class _Formatter(argparse.HelpFormatter):
    """argparse's help formatter, at the width it would choose (see :func:`_terminal_columns`)."""

    def __init__(self, prog, indent_increment=2, max_help_position=24, width=None, **kwargs):
        super().__init__(prog, indent_increment, max_help_position,
                         _terminal_columns() - 2 if width is None else width, **kwargs)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser with :class:`_Formatter`; sub-command parsers are of this class too."""

    def __init__(self, *args, formatter_class=_Formatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)


class _VersionAction(argparse.Action):
    """``--version``: looks the version up only when asked (importlib.metadata is slow)."""

    def __init__(self, option_strings, dest, help=None):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("hostmem")
        except PackageNotFoundError:
            found = "unknown (not installed; run `pip install -e .`)"
        print(f"hostmem {found}")
        parser.exit()


def _skip_exit_collection() -> None:
    """Spare the interpreter's last garbage collection the objects alive now.

    At exit the interpreter collects once more over every object the imports made
    (yaml, typing, inspect: tens of thousands), a tenth of a light command's start.
    A collection finds only cycles, and what a cycle's finalizer would still do at
    exit matters only for something being written; so only a read-only command,
    run as the program (the process ends next), skips it (``gc.freeze``).
    """
    import gc

    gc.freeze()


def _negative_values_joined(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``--max-size -1GiB`` as ``--max-size=-1GiB``: argparse reads a value that starts with a
    dash and is no plain number as another option ("expected one argument"), where the
    option's own parser names what is wrong with it. Only options that take a value are
    joined (a flag's next argument is its own); nothing after ``--`` (a guarded command's
    own arguments) is touched."""
    valued = _options_with_values(parser)
    ends = _ends_in_a_command(parser)  # e.g. guard: from its command's first word on, the command's own
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--" or (i > 0 and argv[0] in ends and not arg.startswith("-")):
            return out + argv[i:]
        if arg in valued and i + 1 < len(argv) and re.match(r"-[\d.]", argv[i + 1]):
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        out.append(arg)
        i += 1
        if arg in valued and i < len(argv):  # the option's value, whatever it looks like
            out.append(argv[i])
            i += 1
    return out


def _ends_in_a_command(parser: argparse.ArgumentParser) -> set[str]:
    """The sub-commands whose last argument is a command of its own (``argparse.REMAINDER``)."""
    found = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if any(a.nargs == argparse.REMAINDER for a in sub._actions):
                    found.add(name)
    return found


def _options_with_values(parser: argparse.ArgumentParser) -> set[str]:
    """The long option strings of ``parser`` and its sub-commands' that take a value."""
    found, todo = set(), [parser]
    while todo:
        current = todo.pop()
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
            elif action.nargs != 0:
                found.update(o for o in action.option_strings if o.startswith("--"))
    return found


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    program = argv is None  # the console script or ``python -m planners.cli``: the process ends after this
    argv = sys.argv[1:] if argv is None else list(argv)
    nul = next((i for i, arg in enumerate(argv, 1) if "\0" in arg), None)
    if nul is not None:  # no shell can pass one; a caller's bug, refused before any file is named by it
        print(f"hostmem: error: argument {nul} ({argv[nul - 1]!r}) holds a NUL byte; no path or value can", file=sys.stderr)
        return 2
    parser = build_parser(argv)
    argv = _negative_values_joined(argv, parser)
    args = parser.parse_args(argv)
    try:
        return _run(args, program)
    finally:
        if program:  # done: a signal during the interpreter's exit must not report it killed
            from planners.commands.stopping import quiet_exit

            quiet_exit()


def _say_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A library's warning as one line of the command's own, not Python's two (file:line and source)."""
    print(f"hostmem: warning: {message}", file=sys.stderr)


def _run(args, program: bool) -> int:
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _say_warning
            code = int(args.run(args) or 0)
        if program and getattr(args, "read_only", False):
            _skip_exit_collection()
        return code
    except BrokenPipeError:  # `hostmem plan ... | head`: the reader left, nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except HostmemError as exc:  # ConfigError, SafetensorsError, a bad size or option, ProcReadError
        print(f"hostmem: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file or folder named on the command line
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"hostmem: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a command that writes says what it kept itself; here, before it began or a query
        command = getattr(args, "command", None)
        print(f"hostmem{' ' + command if command else ''}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
