"""``hostmem inspect``: the residency of a process, or of a set of processes, from /proc."""

from __future__ import annotations

import json
import sys

from hostmem.errors import InputError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="residency of processes: anonymous, file-backed, shmem, pinned",
        description="Classify every mapping of a process (any process you may read) from /proc. With "
        "several --pid, or --cgroup, add the processes up with a page they share counted once.",
    )
    parser.add_argument("--pid", type=int, action="append", default=None,
                        help="process id (default: this command); repeat it for a set of processes")
    parser.add_argument("--cgroup", metavar="PATH", default=None,
                        help="every process of a cgroup folder (v1 or v2: its cgroup.procs)")
    parser.add_argument("--json", action="store_true", help="print the JSON contract (sizes in bytes)")
    parser.add_argument("--top", type=int, default=10, metavar="K", help="mappings to list (0: all)")
    parser.set_defaults(run=run)


def _pids(args) -> list[int]:
    from hostmem.host_aggregate import cgroup_pids

    pids = list(args.pid or [])
    if args.cgroup is not None:
        found = cgroup_pids(args.cgroup)
        if not found:
            raise InputError(f"--cgroup {args.cgroup}: the cgroup holds no process")
        pids.extend(found)
    return list(dict.fromkeys(pids))


def _emit(report, as_json: bool, text: str) -> None:
    if as_json:
        json.dump(report.to_dict(), sys.stdout)
        sys.stdout.write("\n")
    else:
        print(text)


def run(args) -> int:
    if args.top < 0:
        raise InputError(f"--top {args.top}: must be 0 (all) or a positive count")
    pids = _pids(args)
    if len(pids) > 1 or args.cgroup is not None:
        from hostmem.host_aggregate import aggregate_processes

        report = aggregate_processes(pids)
        _emit(report, args.json, report.to_text())
        return 0
    from hostmem.process import inspect_process

    report = inspect_process(pids[0] if pids else None)
    _emit(report, args.json, report.to_text(top=args.top) if not args.json else "")
    return 0
