"""The kohya Flux (BFL names) parser's old functions: the format itself is
:mod:`lora_cache.adapters.formats.kohya_flux`; this reads a file's tensors with it, as
callers of the old path ``lora_cache.adapters.kohya_flux`` (which answers with this
module) did. Its own name, so that no two files of one package share one."""

from __future__ import annotations

from .formats import split_key
from .formats.kohya_flux import CONVERTER, RULES
from .formats.kohya_flux import read as _read
from .formats.kohya_flux import uncovered_stems as _uncovered
from .read import AdapterFile, reading_of

__all__ = ["CONVERTER", "RULES", "read_kohya_flux", "uncovered_stems"]


def uncovered_stems(keys) -> list[str] | None:
    """The stems of ``keys`` the kohya Flux rules do not name, or None when the file is no
    kohya BFL Flux adapter (see :func:`lora_cache.adapters.formats.kohya_flux.uncovered_stems`)."""
    return _uncovered((split_key(key) or (key,))[0] for key in keys)


def read_kohya_flux(path: str, tensors: dict, metadata: dict, why: str) -> AdapterFile:
    """The file (its tensors, views of the read-only mapping, and header metadata) read with
    the kohya Flux rules, saying so and ``why`` in one info line."""
    return _read(reading_of(path, tensors, metadata), why)
