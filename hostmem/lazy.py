"""Package attributes imported on first use (PEP 562), so that importing a package
stays cheap: the command line, the guard and the planner never pay for torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable  # not typing: importing it costs a light command 3 ms


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable, Callable]:
    """Return ``(__getattr__, __dir__)`` for ``package`` serving ``{name: submodule}``."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
