"""Tensor-parallel shards: a rank that holds a part of a weight gets that part of the merge.

A tensor-parallel DiT (xDiT, diffusers-style column- and row-parallel Linear layers)
keeps on each rank a part of a weight under the weight's own name. The adapters stay
made for the whole model; ``lora_cache.merge(model, adapters, shards=...)`` says, per
parameter, which part the rank holds, as ``(dim, index, count)``: part ``index`` of
``count`` equal parts along ``dim``. A server builds it from its own layers, e.g.::

    shards = {}
    for name, module in dit.named_modules():
        if isinstance(module, ColumnParallelLinear):   # out features split: rows
            shards[f"{name}.weight"] = (0, tp_rank, tp_size)
            shards[f"{name}.bias"] = (0, tp_rank, tp_size)
        elif isinstance(module, RowParallelLinear):    # in features split: columns
            shards[f"{name}.weight"] = (1, tp_rank, tp_size)   # its bias is whole on every rank
    lora_cache.merge(dit, adapters, shards=shards)

An explicit spec was chosen over inferring the split from shapes: the server knows its
layers' classes, and a wrong guess (a fused qkv split per projection is not one part of
it) would give a wrong image without an error. The spec is checked instead: a name
that is a module (its weight, its bias?) or no parameter, an index outside the count, a
dim a LoRA cannot split, a part whose shape times the count does not fit the adapters'
change, or a part that lies elsewhere in the checkpoint than the spec says, is refused
with :class:`ShardSpecError`, before anything is merged.

Where each part is merged (:mod:`.plan`): a slice of rows is contiguous in the
row-major layer file, so the rank maps its rows of the whole merged layer's file,
under the same key as a single-process merge (the ranks of a host build it once,
together, and share its page cache); a slice of columns is not, so it is merged on its
own into a per-shard file, under a key that names the sharding (dim 1, part i of n).
Either way its bytes equal that part of a single-process merge, byte for byte
(:mod:`.shard_math` says how); the bias too where it is split.
"""

from .plan import ShardPlan, split_shards
from .spec import Shard, ShardSpecError, check_shards, full_shapes, parse_shard_args, shape_notes

__all__ = ["Shard", "ShardPlan", "ShardSpecError", "check_shards", "full_shapes", "parse_shard_args", "shape_notes",
           "split_shards"]
