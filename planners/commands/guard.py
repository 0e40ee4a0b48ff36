"""``hostmem guard``: run a command and fail it when its peak anonymous memory is too high.

Exit status: the command's own when the peak stays within the limit; 3 when the peak
exceeded it and the command succeeded; the command's own non-zero code when it failed
(the verdict still prints); 128 + N when signal N (Ctrl-C: 130) interrupted the guard,
with one line saying what reached the command and what was cleaned up instead of a
verdict. The one-line verdict goes to stderr; ``--json FILE`` writes the JSON
contract documented in :mod:`hostmem.guard` (``-`` for stdout).
"""

from __future__ import annotations

import argparse
import json
import sys

from hostmem.errors import InputError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "guard",
        help="run a command; exit 3 when its peak anonymous memory exceeds a limit",
        description=(
            "Run CMD while sampling its anonymous resident memory (RssAnon) from a separate "
            "process, and judge the peak against --max-peak-anon. Every process the command "
            "starts is counted (in a memory cgroup of its own where the machine allows it, else "
            "by a tree scan). Exits with the command's code, or 3 when it succeeded but went "
            "over the limit, or 130 when interrupted."
        ),
    )
    parser.add_argument(
        "--max-peak-anon", required=True, metavar="SIZE", help="limit on the peak, e.g. 512MiB or 4GiB"
    )
    parser.add_argument(
        "--interval", default=None, metavar="MS", help="milliseconds between samples (default 1)"
    )
    parser.add_argument(
        "--no-children",
        dest="children",
        action="store_false",
        help="count the command's own process only (default: it and every process it starts)",
    )
    parser.add_argument("--children", dest="children", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--include-shmem", action="store_true", help="count RssShmem (tmpfs, /dev/shm) as well"
    )
    parser.add_argument("--json", default=None, metavar="FILE", help="write the JSON result here ('-': stdout)")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD...", help="the command to run")
    parser.set_defaults(run=run)


def parse_limit(text: str) -> int:
    """Return ``--max-peak-anon`` in bytes; the message names the option on error."""
    from hostmem.units import parse_size

    try:
        limit = parse_size(text)
    except ValueError as exc:
        raise InputError(f"--max-peak-anon: {exc}") from None
    if limit <= 0:
        raise InputError(f"--max-peak-anon {text}: must be more than 0 bytes")
    return limit


def run(args) -> int:
    from hostmem.guard import run_guarded
    from hostmem.peak import parse_interval_ms

    limit = parse_limit(args.max_peak_anon)
    interval_s = parse_interval_ms(args.interval, "--interval")
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise InputError("no command given: hostmem guard --max-peak-anon SIZE [options] -- CMD [ARGS...]")
    json_out = _open_json(args.json)
    try:
        result = run_guarded(
            command, limit, interval_s=interval_s, children=args.children, include_shmem=args.include_shmem
        )
        print(result.interruption() if result.interrupted else result.verdict(), file=sys.stderr)
        if json_out is not None:
            json.dump(result.to_dict(), json_out)
            json_out.write("\n")
    finally:
        if json_out is not None and json_out is not sys.stdout:
            json_out.close()
    return result.guard_exit_code


def _open_json(path: str | None):
    """Open ``--json FILE`` before running, so a bad path fails before the command runs."""
    if path is None:
        return None
    if path == "-":
        return sys.stdout
    try:
        return open(path, "w", encoding="utf-8")
    except OSError as exc:
        raise InputError(f"--json {path}: cannot write ({exc.strerror or exc})") from None
