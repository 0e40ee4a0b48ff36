"""``hostmem inspect``: the residency of a whole process, from /proc."""

from __future__ import annotations

import json
import sys


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="residency of a process: anonymous, file-backed, shmem, pinned",
        description="Classify every mapping of a process (any process you may read) from /proc.",
    )
    parser.add_argument("--pid", type=int, default=None, help="process id (default: this command)")
    parser.add_argument("--json", action="store_true", help="print the JSON contract (sizes in bytes)")
    parser.add_argument("--top", type=int, default=10, metavar="K", help="mappings to list (0: all)")
    parser.set_defaults(run=run)


def run(args) -> int:
    from hostmem.process import inspect_process

    if args.top < 0:
        raise ValueError(f"--top {args.top}: must be 0 (all) or a positive count")
    report = inspect_process(args.pid)
    if args.json:
        json.dump(report.to_dict(), sys.stdout)
        sys.stdout.write("\n")
    else:
        print(report.to_text(top=args.top))
    return 0
