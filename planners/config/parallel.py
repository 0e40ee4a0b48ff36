"""The parallel section: how many ranks share the host, and which components they split.

::

    parallel:
      ranks: 4                 # local ranks (GPUs) on this host, one process each
      tensor_parallel: 4       # ranks that split one copy of the model (divides ranks)
      split: [dit]             # components divided among them (default: the streamed ones)

Each rank holds ``1 / tensor_parallel`` of every split component and a whole copy of the
others; each rank has its own device (``device.vram`` is per rank) and its own reserve.
``hostmem plan --ranks N`` and torchrun's ``LOCAL_WORLD_SIZE`` / ``LOCAL_RANK`` override
``ranks`` (:func:`with_ranks`).
"""

from __future__ import annotations

from typing import Any, Mapping

from hostmem.errors import InputError

from .model import ComponentConfig, ParallelConfig
from .source import ConfigOrigin, Section

__all__ = ["local_world", "parse_parallel", "with_ranks"]

_MAX_RANKS = 1024


def parse_parallel(origin: ConfigOrigin, data: Any, components: Mapping[str, ComponentConfig]) -> ParallelConfig:
    if data is None:
        return ParallelConfig()
    s = Section(origin, "parallel", data, ("ranks", "tensor_parallel", "split"))
    ranks = s.integer("ranks", 1, 1, maximum=_MAX_RANKS)
    tp = s.integer("tensor_parallel", 1, 1, maximum=_MAX_RANKS)
    if ranks % tp:
        raise origin.error("parallel.tensor_parallel",
                           f"{tp} does not divide parallel.ranks ({ranks}); each group of {tp} ranks splits one copy "
                           "of the model, so ranks must be a multiple of it")
    split = _split(s, components, tp)
    return ParallelConfig(ranks=ranks, tensor_parallel=tp, split=split, source="config")


def _split(s: Section, components: Mapping[str, ComponentConfig], tp: int) -> tuple[str, ...]:
    value = s.get("split")
    if value is None:
        return tuple(c.name for c in components.values() if c.offload == "layerwise") if tp > 1 else ()
    if tp == 1:
        raise s.origin.error("parallel.split", "nothing is split without tensor_parallel above 1; set "
                             "tensor_parallel or remove split")
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise s.origin.error("parallel.split", f"expected a list of component names, e.g. [dit], found {value!r}")
    unknown = [v for v in value if v not in components]
    if unknown:
        raise s.origin.error("parallel.split", f"{', '.join(unknown)} is not a component; name one of "
                             f"{', '.join(components)}")
    return tuple(dict.fromkeys(value))


def local_world(environ: Mapping[str, str]) -> tuple[int, int] | None:
    """``(LOCAL_RANK, LOCAL_WORLD_SIZE)`` as torchrun sets them, or None when absent."""
    size, rank = environ.get("LOCAL_WORLD_SIZE"), environ.get("LOCAL_RANK")
    if size is None:  # LOCAL_RANK alone (-1 in many scripts' defaults, an old launcher's): one rank
        return None
    try:
        size_i, rank_i = int(size), int(rank or 0)
    except ValueError:
        raise InputError(f"LOCAL_WORLD_SIZE={size!r}, LOCAL_RANK={rank!r}: expected whole numbers (torchrun sets "
                         "them); unset them to plan for one rank") from None
    if not 1 <= size_i <= _MAX_RANKS:
        raise InputError(f"LOCAL_WORLD_SIZE={size_i}: the ranks on this host are 1 to {_MAX_RANKS}, as --ranks "
                         "takes them; unset it to plan for one rank")
    if not 0 <= rank_i < size_i:
        raise InputError(f"LOCAL_RANK={rank_i} is not within LOCAL_WORLD_SIZE={size_i} (0 to {size_i - 1})")
    return rank_i, size_i


def with_ranks(parallel: ParallelConfig, ranks: int | None, environ: Mapping[str, str]) -> ParallelConfig:
    """``parallel`` with the ranks of the command line (``--ranks``), else torchrun's
    ``LOCAL_WORLD_SIZE`` and ``LOCAL_RANK`` where set, else as configured."""
    found = local_world(environ)
    if ranks is not None:
        if not 1 <= ranks <= _MAX_RANKS:
            raise InputError(f"--ranks {ranks}: give a whole number from 1 to {_MAX_RANKS}")
        local = found[0] if found is not None and found[0] < ranks else 0
        parallel = parallel._replace(ranks=ranks, local_rank=local, source="--ranks")
    elif found is not None:
        parallel = parallel._replace(ranks=found[1], local_rank=found[0], source="LOCAL_WORLD_SIZE")
    if parallel.ranks % parallel.tensor_parallel:
        raise InputError(f"{parallel.ranks} ranks ({parallel.source}) are not a multiple of parallel.tensor_parallel "
                         f"({parallel.tensor_parallel}); give a multiple, or change the config")
    return parallel
