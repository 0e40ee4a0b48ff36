"""The whole base weight of a contiguous shard, mapped read-only from its checkpoint.

A rank that holds rows i of n of a weight maps the rows of the whole merged layer's
file, so the whole layer must be merged once (by whichever rank of the host builds it)
from the whole base. The rank has only its rows, but the checkpoint has the whole
tensor: found by where the rank's rows lie in a mapped checkpoint (free, and it checks
that they are the part the spec names), else by name and shape in ``base_files``.
None when neither finds it: the shard is then merged on its own, into a file of its own.
"""

from __future__ import annotations

import os

import torch

from hostmem.safetensors.header import read_header
from hostmem.safetensors.mapping import open_readonly

from ...targets.layer_target import AddressSpace
from .spec import Shard, ShardSpecError

__all__ = ["WholeWeights"]


def _suffixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[i:]) for i in range(len(parts))]


class WholeWeights:
    """Finds whole weights in checkpoint files, each file's header read and mapped once."""

    def __init__(self, base_files, space: AddressSpace):
        self.base_files = [os.path.realpath(os.fspath(p)) for p in base_files or []]
        self.space = space
        self._mapped: dict[str, object] = {}

    def _tensor(self, path: str, name: str) -> torch.Tensor:
        if path not in self._mapped:
            self._mapped[path] = open_readonly(path)
        return self._mapped[path].get_tensor(name)

    def find(self, name: str, held: torch.Tensor, shard: Shard) -> torch.Tensor | None:
        """The whole weight ``held`` is ``shard`` of, as a read-only mapped tensor, or None."""
        full = shard.full_shape(tuple(held.shape))
        found = self._by_address(name, held, shard, full)
        return found if found is not None else self._by_name(name, held, full)

    def _by_address(self, name: str, held: torch.Tensor, shard: Shard, full: tuple) -> torch.Tensor | None:
        """The checkpoint tensor whose bytes hold ``held`` (a view of a mapped file)."""
        area = self.space.area_of(held) if held.device.type == "cpu" else None
        path = area.path if area is not None and area.is_file else None
        if path is None or not path.startswith("/") or path.endswith(" (deleted)"):
            return None
        try:
            header = read_header(path)
        except (OSError, ValueError):
            return None
        at = held.data_ptr() - area.start + area.offset  # the part's offset in the file
        for info in header.tensors.values():
            start = header.data_offset + info.begin
            if not start <= at < header.data_offset + info.end:
                continue
            if tuple(info.shape) != full or info.torch_dtype != held.dtype:
                return None  # a tensor of another shape: a checkpoint saved already sharded
            part, offset = divmod(at - start, held.numel() * held.element_size())
            if offset or part != shard.index:
                raise ShardSpecError(
                    f"shards[{name!r}] = {tuple(shard)}: the model's {name!r} lies at byte {at - start} of "
                    f"{info.name!r} in {path}, which is not the start of part {shard.index} of {shard.count} along "
                    f"dim {shard.dim}" + (f" but of part {part}" if not offset else "")
                    + "; pass this rank's part as its index"
                )
            return self._tensor(path, info.name)
        return None

    def _by_name(self, name: str, held: torch.Tensor, full: tuple) -> torch.Tensor | None:
        """The one tensor of ``base_files`` named like ``name`` (up to wrapper prefixes on
        either side) with the whole shape and the dtype; several is an error."""
        wanted = set(_suffixes(name))
        found = []
        for path in self.base_files:
            for info in read_header(path).tensors.values():
                named = info.name in wanted or name in _suffixes(info.name)
                if named and tuple(info.shape) == full and info.torch_dtype == held.dtype:
                    found.append((path, info.name))
        if len(found) > 1:
            raise ShardSpecError(
                f"{name!r}: several tensors of base_files could be its whole weight "
                f"({', '.join(f'{n!r} in {p}' for p, n in found[:3])}); pass only the checkpoint the model "
                "was loaded from"
            )
        return self._tensor(*found[0]) if found else None
