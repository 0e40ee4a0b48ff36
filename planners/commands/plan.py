"""``hostmem plan CONFIG``: the startup report of a deployment, before loading anything."""

from __future__ import annotations

import sys


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="host budget, device plan and pin plans of a deployment config",
        description=(
            "Plan a deployment from its config: component sizes from safetensors headers or "
            "declared sizes, residency predicted from how weights are loaded and merged, the "
            "host budget, the device plan and the pin plans. Reads no weights."
        ),
    )
    parser.add_argument("config", metavar="CONFIG", help="a deployment config (configs/*.yaml)")
    parser.add_argument("--json", action="store_true", help="print the JSON contract (sizes in bytes)")
    parser.add_argument(
        "--what-if",
        dest="what_if",
        choices=("none", "in-place", "cached"),
        default=None,
        help="the LoRA merge to predict (default: cached if lora.cache is enabled, in-place if not, "
        "none without adapters)",
    )
    parser.add_argument(
        "--check", action="store_true",
        help="exit 1 when the plan does not fit (0 when it does, 2 for a bad config): a gate for CI",
    )
    parser.add_argument(
        "--ranks", type=int, default=None, metavar="N",
        help="plan N alike ranks on this host (default: parallel.ranks of the config, or torchrun's "
        "LOCAL_WORLD_SIZE where set): each rank's share and a verdict for the host",
    )
    parser.set_defaults(run=run, read_only=True)  # writes nothing: cli.main may skip the exit collection


def run(args) -> int:
    from planners.config import load_config
    from planners.plan_build import build_plan
    from planners.report import report_dict, report_text

    plan = build_plan(load_config(args.config), args.what_if, args.ranks)
    if args.json:
        import json  # here: the text report needs no JSON

        json.dump(report_dict(plan), sys.stdout)
        sys.stdout.write("\n")
    else:
        print(report_text(plan))
    return 1 if args.check and not plan.fits else 0
