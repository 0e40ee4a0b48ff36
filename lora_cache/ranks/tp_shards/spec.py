"""What a rank holds of a weight: :class:`Shard`, and the check of a ``shards=`` spec.

A tensor-parallel rank holds, under a weight's own name, one of ``count`` equal parts of
it along one dimension: dim 0 (a slice of rows: a column-parallel Linear, its out
features split) or dim 1 (a slice of columns: a row-parallel Linear, its in features
split). A LoRA's delta is ``(out, in, ...)``, so those are the only two dimensions a
shard may split; the adapters stay made for the full model.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import NamedTuple

from hostmem.errors import HostmemError

__all__ = ["Shard", "ShardSpecError", "check_shards", "full_shapes", "parse_shard_args", "shape_notes"]

_HOW = ("shards={'<parameter name>': (dim, index, count)}: dim 0 for a slice of rows (column-parallel), "
        "dim 1 for a slice of columns (row-parallel), index = this rank's part, count = the parallel degree")


class ShardSpecError(HostmemError, ValueError):
    """A ``shards=`` spec that is ambiguous or does not fit the model; the message says which
    parameter, what is wrong and what to pass instead."""


class Shard(NamedTuple):
    """Part ``index`` of ``count`` equal parts of a weight along ``dim`` (0: rows, 1: columns)."""

    dim: int
    index: int
    count: int

    def full_shape(self, held: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the whole weight, given the shape of the part a rank holds."""
        return tuple(n * self.count if d == self.dim else n for d, n in enumerate(held))

    def bounds(self, full: tuple[int, ...]) -> slice:
        """The part's range along :attr:`dim` of the whole weight."""
        size = full[self.dim] // self.count
        return slice(self.index * size, (self.index + 1) * size)

    def part(self, whole):
        """This part of the ``whole`` tensor, as a view of it (what the rank holds)."""
        own = self.bounds(tuple(whole.shape))
        return whole.narrow(self.dim, own.start, own.stop - own.start)

    def contiguous(self, full: tuple[int, ...]) -> bool:
        """Whether the part is one run of bytes of the whole row-major weight (then it is a
        view at an offset of the whole weight's file)."""
        return math.prod(full[: self.dim]) == 1

    def describe(self) -> str:
        """The sharding as the cache key and the stats name it."""
        return f"shard(dim={self.dim},part={self.index}of{self.count})"

    def merged(self, base, deltas, out, scratch, workers=None, claim=None, publish=None, kernel=None):
        """Write this part of the whole layer's merge into ``out`` (``base`` is the part held,
        ``deltas`` the whole layer's); see :func:`lora_cache.tp_shards.shard_math.shard_merged`."""
        from .shard_math import shard_merged  # torch: only when a shard is merged

        return shard_merged(base, deltas, self, out, scratch, workers, claim, publish,
                            **({} if kernel is None else {"kernel": kernel}))


def _as_shard(name: str, value) -> Shard:
    """``value`` as a :class:`Shard`, or a :class:`ShardSpecError` naming ``name``."""
    fields = tuple(value) if isinstance(value, (tuple, list)) else None
    if fields is None or len(fields) != 3 or not all(
        isinstance(f, numbers.Integral) and not isinstance(f, bool) for f in fields
    ):
        raise ShardSpecError(f"shards[{name!r}] = {value!r}: expected (dim, index, count) as three integers; {_HOW}")
    shard = Shard(*(int(f) for f in fields))
    if shard.count < 1 or not 0 <= shard.index < shard.count:
        raise ShardSpecError(
            f"shards[{name!r}] = {tuple(shard)}: index {shard.index} is not a part of {shard.count} "
            f"(expected 0 <= index < count, count >= 1); pass this rank's index in its tensor-parallel group"
        )
    return shard


def _unknown(name: str, shapes: Mapping[str, tuple[int, ...]]) -> ShardSpecError:
    """The error for a spec entry that names no parameter: a module's name is ambiguous
    (its weight, its bias or both?), anything else is not in the model."""
    inside = sorted(p for p in shapes if p.startswith(name + ".") and "." not in p[len(name) + 1:])
    if inside:
        return ShardSpecError(
            f"shards[{name!r}] names a module, not a parameter: say which of its parameters this rank "
            f"holds a part of ({', '.join(repr(p) for p in inside)}), each with its own (dim, index, count)"
        )
    examples = ", ".join(repr(p) for p in list(shapes)[:3])
    return ShardSpecError(
        f"shards[{name!r}]: the model has no parameter of that name (its names look like {examples}); "
        "use the names of model.named_parameters() (prefixed by the component for a dict of models)"
    )


def _check_fits(name: str, shard: Shard, held: tuple[int, ...]) -> None:
    """A shard splits dim 0 or 1 of a parameter that has that dimension."""
    if shard.dim not in (0, 1) or shard.dim >= len(held):
        raise ShardSpecError(
            f"shards[{name!r}] = {tuple(shard)}: dim {shard.dim} cannot be split for a parameter of shape "
            f"{held}; a LoRA changes a weight as (out, in, ...), so a part is a slice along dim 0 (rows) or, "
            "for a weight of two or more dimensions, dim 1 (columns)"
        )


def check_shards(shards, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Shard]:
    """``shards`` (``{parameter name: (dim, index, count)}``) checked against the model's
    parameter ``shapes``; returns the entries that split something (count above 1).

    Refused with :class:`ShardSpecError`: not a mapping, a value that is not three
    integers, an index outside the count, a name that is a module (ambiguous: its
    weight or its bias?) or no parameter at all, a dim a LoRA cannot split.
    """
    if not isinstance(shards, Mapping):
        raise ShardSpecError(f"shards={type(shards).__name__}: expected a mapping; {_HOW}")
    checked: dict[str, Shard] = {}
    for name, value in shards.items():
        shard = _as_shard(name, value)
        if name not in shapes:
            raise _unknown(str(name), shapes)
        _check_fits(name, shard, tuple(shapes[name]))
        if shard.count > 1:
            checked[name] = shard
    return checked


def parse_shard_args(args: list[str], option: str = "--shard") -> dict[str, tuple[int, int, int]]:
    """Command-line parts, each ``NAME=DIM:INDEX:COUNT``, as a ``shards=`` spec (checked
    against the model later, by :func:`check_shards`). A malformed one, or a name given
    twice, is a :class:`ShardSpecError` that quotes the argument and shows the form."""
    form = f"expected {option} NAME=DIM:INDEX:COUNT, e.g. {option} blocks.0.attn.to_q.weight=0:1:4 (rows, part 1 of 4)"
    spec: dict[str, tuple[int, int, int]] = {}
    for arg in args:
        name, sep, fields = arg.partition("=")
        parts = fields.split(":")
        if not sep or not name or len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
            raise ShardSpecError(f"{option} {arg!r}: {form}")
        if name in spec:
            raise ShardSpecError(f"{option} {arg!r}: {name!r} is given twice; give each parameter's part once")
        try:
            spec[name] = tuple(_as_shard(name, tuple(int(p) for p in parts)))
        except ShardSpecError as exc:  # an index outside the count
            raise ShardSpecError(f"{option} {arg!r}: {exc}") from None
    return spec


def full_shapes(shapes: Mapping[str, tuple[int, ...]], held: Mapping[str, Shard]) -> dict[str, tuple[int, ...]]:
    """Every parameter's whole shape: what the adapters are made for."""
    return {name: held[name].full_shape(tuple(shape)) if name in held else tuple(shape)
            for name, shape in shapes.items()}


def shape_notes(shapes: Mapping[str, tuple[int, ...]], held: Mapping[str, Shard]) -> dict[str, str]:
    """For an adapter whose change does not fit a sharded parameter: what the spec said."""
    return {
        name: (f" (the whole weight: shards= says this rank holds part {s.index} of {s.count} along dim "
               f"{s.dim}, shape {tuple(shapes[name])}; is that spec right?)")
        for name, s in held.items()
    }
