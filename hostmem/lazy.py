"""Package attributes imported on first use (PEP 562), so that importing a package
stays cheap: the command line, the guard and the planner never pay for torch; and old
module paths that keep answering after a module moved to another room."""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
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


class _MovedModules:
    """A finder on ``sys.meta_path`` that answers an old module path with the module now
    holding its code, so the old path keeps working without a re-export file beside the new
    room: the very module object is returned, private names and patches included."""

    def __init__(self, table: dict[str, str]):
        self.table = table
        self.specs: dict = {}  # new name -> the new module's own spec, kept across the import

    def find_spec(self, name: str, path=None, target=None):
        if name not in self.table:
            return None
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec):
        module = importlib.import_module(self.table[spec.name])
        self.specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module) -> None:
        """Nothing to run: the new module ran when it was imported. The import system has
        just set its ``__spec__`` to the old path's; the new one is put back, or a relative
        import inside a function of the module would resolve against the old path's
        package and warn (``__package__ != __spec__.parent``)."""
        module.__spec__ = self.specs[module.__name__]


def moved_modules(package: str, moved: dict[str, str]) -> None:
    """Keep ``package.OLD`` importable as ``package.NEW`` for every ``{OLD: NEW}`` in ``moved``."""
    table = {f"{package}.{old}": f"{package}.{new}" for old, new in moved.items()}
    sys.meta_path.insert(0, _MovedModules(table))
