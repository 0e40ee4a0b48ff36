"""The ``hostmem`` command line.

Each sub-command lives in its own module under ``planners.commands`` with a
``register(subparsers)`` that adds its parser and sets ``run``; ``run(args)``
returns the exit code. Errors a person can act on are printed as one line
``hostmem: error: ...`` with exit code 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

COMMANDS = ("inspect", "plan", "guard", "lora", "cache", "demo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hostmem",
        description="Host-memory accounting and offload planning for diffusion-model serving.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"planners.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    from hostmem.procfs import ProcReadError
    from hostmem.safetensors_header import SafetensorsError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except BrokenPipeError:  # `hostmem plan ... | head`: the reader left, nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (ProcReadError, SafetensorsError, ValueError) as exc:
        print(f"hostmem: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file or folder named on the command line or in a config
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"hostmem: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
