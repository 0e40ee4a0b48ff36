"""``hostmem demo``: the 32 GiB story, measured on this machine."""

from __future__ import annotations

import importlib.util
import json
import sys
import time

from hostmem.errors import InputError
from hostmem.units import size_option


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="measure a synthetic DiT start four ways: no LoRA, in-place merge, cached merge (miss, hit)",
        description="Write a synthetic DiT, text encoder and LoRA adapter, start each scenario in its own "
        "process under the peak tracker, and print what each costs the host.",
    )
    parser.add_argument("--scale", default="4GiB", type=size_option, metavar="SIZE",
                        help="size of the synthetic DiT (default 4GiB)")
    parser.add_argument("--host-limit", default=None, metavar="SIZE", type=size_option,
                        help="host convention (default: 32 GiB scaled to the DiT as to MiniMax-H3's 61.7 GB)")
    parser.add_argument("--workdir", default=None, metavar="DIR",
                        help="where to write the files (default: a temporary folder on a real disk, removed after)")
    parser.add_argument("--json", default=None, metavar="FILE", help="write every figure as JSON (bytes, seconds)")
    parser.add_argument("--plot", default=None, metavar="FILE", help="draw the anonymous-memory timelines (matplotlib)")
    parser.add_argument("--cgroup", action="store_true",
                        help="also run scenarios 2 and 4 under a real memory cgroup at the host limit")
    parser.set_defaults(run=run)


def _what_was_kept(args) -> str:
    """One line: what an interrupted demo leaves behind, and how to run it again."""
    cgroup = "; the memory cgroup was removed" if args.cgroup else ""
    if args.workdir:
        return (f"the files written so far are kept in {args.workdir}{cgroup}; run the same command "
                "again to start over (it rewrites them), or delete that folder")
    return f"its temporary files were removed{cgroup}; run the same command again to start over"


def run(args) -> int:
    from planners.demo.run import DemoError, elapsed_since, format_table, parse_settings, plot_timelines, run_demo

    settings = parse_settings(args.scale, args.host_limit, args.workdir, args.cgroup)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise InputError(f"--plot {args.plot}: matplotlib is not installed; `pip install matplotlib` (or drop --plot)")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:  # fail now, not after minutes of work
            try:
                open(path, "a").close()
            except OSError as exc:
                raise InputError(f"{flag} {path}: cannot write there ({exc.strerror})") from None
    started = time.perf_counter()
    try:
        demo = run_demo(settings)
    except DemoError as exc:
        print(f"hostmem: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nhostmem demo: interrupted; {_what_was_kept(args)}", file=sys.stderr)
        return 130
    print(format_table(demo))
    best = next(s for s in demo.scenarios if s.name == "cached_hit")
    print(f"\nstartup report of scenario 4 (cached merge, second start):\n{best.report_text}")
    print(f"\ndemo finished in {elapsed_since(started)}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(demo.to_dict(), handle, indent=1)
        print(f"figures written to {args.json}", file=sys.stderr)
    if args.plot:
        plot_timelines(demo, args.plot)
        print(f"timelines drawn in {args.plot}", file=sys.stderr)
    return 0
