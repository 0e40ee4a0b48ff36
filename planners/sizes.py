"""Component sizes: per layer, with where each layer's bytes live.

The planners only ever see numbers. A component is a tuple of :class:`Layer` (the
units that stream and get pinned, grouped by a name pattern such as
``"blocks.{i}."``) plus ``rest`` (tensors outside every layer: embeddings, final
norms) and ``extra`` (memory the component holds besides its weights, such as an
unmerge snapshot). The same shape comes from three sources, so a plan made before
loading (headers or declared sizes) and one made after (a live Ledger) compare
directly:

- :func:`from_declared`: ``size`` split evenly over ``layers``;
- ``planners.checkpoint.read_checkpoint``: safetensors headers;
- :func:`from_ledger`: a component of a :class:`hostmem.Ledger` (measured residency).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from operator import attrgetter
from typing import NamedTuple

from hostmem.residency_classes import CLASSES, Residency

__all__ = [
    "Layer",
    "ComponentSizes",
    "layer_matcher",
    "group_layers",
    "spread",
    "with_lora_target_bytes",
    "from_declared",
    "from_ledger",
    "sum_residency",
    "with_residency",
    "REST",
]

REST = "(rest)"

# Residency's fields in order (both a dataclass and a NamedTuple list them here).
_RESIDENCY_FIELDS: tuple[str, ...] = Residency.__match_args__
_residency_values = attrgetter(*_RESIDENCY_FIELDS)  # Residency -> tuple of its fields


def sum_residency(parts: Iterable[Residency]) -> Residency:
    """The sum of ``parts`` (``Residency()`` when empty), built once.

    Adding a component's few hundred layers one ``+`` at a time builds as many
    intermediate objects; a plan sums every component several times.
    """
    columns = zip(*map(_residency_values, parts))  # one tuple per class; none when empty
    return Residency(*map(sum, columns))


def with_residency(residency: Residency, **changes: int) -> Residency:
    """``residency`` with the classes named in ``changes`` set to new values."""
    return Residency(*(changes.get(name, getattr(residency, name)) for name in _RESIDENCY_FIELDS))


class Layer(NamedTuple):
    """One unit that moves and is pinned whole. ``residency`` sums to ``nbytes``.

    A named tuple, like the other records the planners build: they are defined on
    every start of ``hostmem plan`` and copied thousands of times per plan, and a
    dataclass costs several times more at both.
    """

    name: str
    nbytes: int
    residency: Residency
    lora_target_bytes: int = 0
    cast_bytes: int = 0  # held in another dtype than the file's (components.NAME.dtype): copies, never views

    @property
    def non_reclaimable(self) -> int:
        return self.residency.non_reclaimable

    @property
    def reclaimable(self) -> int:
        """Bytes the kernel may drop (page cache, or not faulted in yet).

        These are what an unpinned layer needs in page cache to move without a disk
        read, and what pinning the layer in place adds to non-reclaimable memory:
        the pin's net cost. Bytes already anonymous or pinned cost nothing more.
        """
        return max(0, self.nbytes - self.residency.non_reclaimable)


class ComponentSizes(NamedTuple):
    """A component's layers, the rest of its tensors, and memory it holds besides."""

    name: str
    offload: str
    source: str  # "headers", "declared" or "ledger"
    layers: tuple[Layer, ...]
    rest: Layer | None = None
    extra: Residency = Residency()  # frozen: one shared default is safe
    dtype: str | None = None
    notes: tuple[str, ...] = ()  # how the sizes were read, where the plan should say so
    # numbered groups of tensors in the rest, (pattern, blocks, bytes, depth: the most name
    # levels below the number, 3 for blocks.0.attn.to_q.weight): blocks no layers pattern
    # names (Flux's single_transformer_blocks); None where the names are not known
    rest_families: tuple[tuple[str, int, int, int], ...] | None = None
    # bytes of its parameters on a device already (a text encoder a server moved there):
    # device memory the plan counts, not host memory
    device_bytes: int = 0

    @property
    def units(self) -> tuple[Layer, ...]:
        """Layers, then the rest as one more unit: what a full offload moves."""
        return self.layers + ((self.rest,) if self.rest is not None and self.rest.nbytes else ())

    @property
    def weights_bytes(self) -> int:
        return sum(u.nbytes for u in self.units)

    @property
    def lora_target_bytes(self) -> int:
        return sum(u.lora_target_bytes for u in self.units)

    @property
    def residency(self) -> Residency:
        """Residency of the weights plus ``extra``."""
        return sum_residency((self.extra, *(unit.residency for unit in self.units)))

    def with_units(self, units: Iterable[Layer]) -> "ComponentSizes":
        """A copy whose layers and rest are replaced by ``units`` (same order)."""
        units = tuple(units)
        if self.rest is not None and self.rest.nbytes and units and units[-1].name == REST:
            return self._replace(layers=units[:-1], rest=units[-1])
        return self._replace(layers=units)


def layer_matcher(pattern: str | tuple[str, ...]):
    """Return ``match(name) -> (order, block name) | None`` for patterns like ``"blocks.{i}."``.

    ``pattern`` is one pattern or several (Flux: ``"transformer_blocks.{i}."`` and
    ``"single_transformer_blocks.{i}."``); each matches at the start of a tensor name,
    the first that matches wins, and a block's name is its pattern with the index
    filled in, without a trailing dot (``blocks.7``). ``order`` sorts blocks as the
    model runs them: every block of the first pattern, then those of the next.
    """
    patterns = (pattern,) if isinstance(pattern, str) else tuple(pattern)
    compiled = []
    for family, one in enumerate(patterns):
        head, _, tail = one.partition("{i}")
        compiled.append((family, head, tail, re.compile(re.escape(head) + r"(\d+)" + re.escape(tail))))

    def match(name: str):
        for family, head, tail, regex in compiled:
            found = regex.match(name)
            if found is not None:
                index = int(found.group(1))
                return (family, index), f"{head}{index}{tail}".rstrip(".")
        return None

    return match


def group_layers(
    named: Iterable[tuple[str, int, Residency | None]],
    pattern: str | tuple[str, ...] | None,
    lora_patterns: tuple[str, ...] = (),
    cast: frozenset[str] = frozenset(),
) -> tuple[tuple[Layer, ...], Layer | None]:
    """Group ``(tensor name, bytes, residency)`` into layers (by index) and the rest;
    ``cast``: the names held in another dtype than the file's (their bytes: the served ones).

    A residency of ``None`` means not known yet (every byte not resident). Sums are
    kept as plain integers: a checkpoint has thousands of tensors.
    """
    match = layer_matcher(pattern) if pattern else (lambda name: None)
    groups: dict[tuple[tuple[int, int], str], list[int]] = {}
    rest = [0] * (3 + len(CLASSES))  # bytes, lora target bytes, each residency class, cast bytes
    for name, nbytes, residency in named:
        found = match(name)
        slot = rest if found is None else groups.setdefault(found, [0] * (3 + len(CLASSES)))
        slot[0] += nbytes
        if name in cast:
            slot[-1] += nbytes
        if lora_patterns and any(fnmatch.fnmatchcase(name, p) for p in lora_patterns):
            slot[1] += nbytes
        if residency is None:
            slot[2 + CLASSES.index("not_resident")] += nbytes
        else:
            for i, cls in enumerate(CLASSES, start=2):
                slot[i] += getattr(residency, cls)

    def layer(name: str, slot: list[int]) -> Layer:
        return Layer(name, slot[0], Residency(**dict(zip(CLASSES, slot[2:-1]))), slot[1], slot[-1])

    layers = tuple(layer(key[1], slot) for key, slot in sorted(groups.items()))
    return layers, (layer(REST, rest) if rest[0] else None)


_NUMBERED = re.compile(r"^(.*?)\.(\d+)\.")


def rest_families(named: Iterable[tuple[str, int, Residency | None]],
                  pattern: str | tuple[str, ...] | None) -> tuple[tuple[str, int, int, int], ...]:
    """The numbered groups among the tensors no layer pattern names, ``(pattern, blocks,
    bytes, depth)`` largest first: ``single_transformer_blocks.{i}.`` where only
    ``transformer_blocks.{i}.`` is listed. Embeddings and heads (``x_embedder``,
    ``proj_out``) hold no number, whatever their size; :func:`missed_families` says which
    groups are blocks a pattern missed."""
    match = layer_matcher(pattern) if pattern else (lambda name: None)
    found: dict[str, tuple[set, int, int]] = {}
    for name, nbytes, _ in named:
        numbered = _NUMBERED.match(name)
        if numbered is None or match(name) is not None:
            continue
        indices, total, depth = found.get(numbered[1], (set(), 0, 0))
        indices.add(int(numbered[2]))
        found[numbered[1]] = (indices, total + nbytes, max(depth, name[numbered.end():].count(".") + 1))
    families = [(f"{prefix}.{{i}}.", len(indices), total, depth) for prefix, (indices, total, depth) in found.items()]
    return tuple(sorted(families, key=lambda family: -family[2]))


# a numbered group in the rest is a missed family of blocks when it has two or more blocks
# and this share of the weights (a text encoder's two refiner blocks are not); or, one block
# of a kind (the README's tiny Flux), when it holds modules of modules (a block's
# attn.to_q.weight, never a Sequential's 1.weight: Wan's time_projection) and is at least
# this share of a median layer
_FAMILY_SHARE, _BLOCK_SHARE, _BLOCK_DEPTH = 0.02, 0.25, 3


def missed_families(sizes: "ComponentSizes") -> tuple[tuple[str, int, int], ...]:
    """The numbered groups of ``sizes``' rest that are blocks its layers patterns missed,
    ``(pattern, blocks, bytes)``."""
    if not sizes.rest_families or not sizes.weights_bytes:
        return ()
    layer_bytes = sorted(u.nbytes for u in sizes.layers)
    median = layer_bytes[len(layer_bytes) // 2] if layer_bytes else 0
    return tuple((family, blocks, nbytes) for family, blocks, nbytes, depth in sizes.rest_families
                 if (blocks > 1 and nbytes > _FAMILY_SHARE * sizes.weights_bytes)
                 or (blocks == 1 and depth >= _BLOCK_DEPTH and median and nbytes >= _BLOCK_SHARE * median))


def spread(total: int, weights: list[int]) -> list[int]:
    """Split ``total`` over items in proportion to ``weights``, exactly (largest remainder)."""
    whole = sum(weights)
    if whole <= 0 or total <= 0:
        return [0] * len(weights)
    shares = [total * w // whole for w in weights]
    leftover = total - sum(shares)
    order = sorted(range(len(weights)), key=lambda i: -(total * weights[i] % whole))
    for i in order[:leftover]:
        shares[i] += 1
    return shares


def with_lora_target_bytes(sizes: ComponentSizes, target_bytes: int) -> ComponentSizes:
    """Spread declared LoRA target bytes over the layers in proportion to their size."""
    layers = list(sizes.layers) or list(sizes.units)
    shares = spread(min(target_bytes, sum(u.nbytes for u in layers)), [u.nbytes for u in layers])
    updated = [u._replace(lora_target_bytes=s) for u, s in zip(layers, shares)]
    if sizes.layers:
        return sizes._replace(layers=tuple(updated))
    return sizes.with_units(updated)


def from_declared(
    name: str,
    offload: str,
    size: int,
    layer_count: int | None,
    lora_target_bytes: int | None = None,
    dtype: str | None = None,
) -> ComponentSizes:
    """Sizes of a component known only by its declared total and layer count.

    Declared bytes are all in the layers (``size // layers`` each, the remainder
    spread one byte at a time), so the sum is exactly ``size``. Residency is
    unknown until predicted: every byte starts not resident.
    """
    count = layer_count or 1
    prefix = "layers" if layer_count else name
    shares = spread(size, [1] * count)
    targets = spread(min(lora_target_bytes or 0, size), shares)  # as with_lora_target_bytes spreads them
    layers = tuple(
        Layer(f"{prefix}.{i}" if layer_count else prefix, n, Residency(not_resident=n), t)
        for i, (n, t) in enumerate(zip(shares, targets))
    )
    return ComponentSizes(name=name, offload=offload, source="declared", layers=layers, dtype=dtype)


def from_ledger(
    ledger_component,
    offload: str,
    pattern: str | None,
    lora_patterns: tuple[str, ...] = (),
    lora_target_bytes: int | None = None,
) -> ComponentSizes:
    """Sizes and measured residency of a component of a :class:`hostmem.Ledger`.

    Parameters on a device are not host memory and are left out of the layers; their
    bytes are ``device_bytes``, which the device plan counts. A storage shared by several
    names was counted once by the accountant, under its first name.
    """
    entries = [p for p in ledger_component.parameters.values() if p.device == "cpu"]
    named = [(p.name, p.nbytes, p.residency) for p in entries]
    layers, rest = group_layers(named, pattern, lora_patterns)
    sizes = ComponentSizes(ledger_component.name, offload, "ledger", layers, rest,
                           rest_families=rest_families(named, pattern),
                           device_bytes=ledger_component.device_bytes)
    return with_lora_target_bytes(sizes, lora_target_bytes) if lora_target_bytes else sizes
