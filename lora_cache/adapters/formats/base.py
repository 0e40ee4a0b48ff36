"""What the reader hands an adapter format module, and what every such module offers.

A format module (one file in this folder) has:

- ``NAME``: the format's name, as :attr:`AdapterFile.format` reports it;
- ``ROLES``: ``(suffix, role)`` pairs, the key suffixes it adds to the reader's table
  (roles: ``down``, ``up``, ``up_b``, ``alpha``, ``diff``, ``diff_b``, ``magnitude``,
  ``dora_scale``);
- ``claims(keys, metadata)``: whether a file with these keys and header metadata is
  of this format (cheap: names only, never values);
- ``read(reading)``: the file as an :class:`~lora_cache.adapters.read.AdapterFile`.
- optionally ``DIFFUSERS_READS = False``: on a diffusers model the file is read by
  lora_cache's reader, not diffusers' converter (which does not know the format).

The reader tries the modules in the order of :data:`lora_cache.adapters.formats.FORMATS`
and reads a file with the first that claims it. The reader's grouping of keys by suffix
is handed in (:attr:`Reading.build`) rather than imported, so a format module sits
below the reader and needs nothing but this file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

__all__ = ["Reading"]


class Reading(NamedTuple):  # a NamedTuple, not a dataclass: the plan's imports stay light
    """One adapter file being read: its tensors (views of the read-only mapping), header
    metadata, and the reader's tools: ``split_key(key)`` -> ``(stem, role)`` or None, and
    ``build(**options)``, the file grouped by stem into an ``AdapterFile`` (options:
    ``converter``, ``values_check``, ``rules``; see ``build_adapter_file``)."""

    path: str
    tensors: dict
    metadata: dict
    split_key: Callable[[str], tuple[str, str] | None]
    build: Callable[..., object]
