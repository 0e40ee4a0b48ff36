"""One call for diffusers users: ``lora_cache.load_lora(pipe, "style.safetensors")``.

It takes what ``pipe.load_lora_weights`` takes (a file, the folder diffusers or peft
wrote, with ``weight_name=`` to pick a file in it) or several adapters with strengths,
converts the keys with the pipeline class's own ``lora_state_dict``, and merges through
the LoRA cache into every component the adapter targets. The result is diffusers'
``load_lora_weights`` + ``fuse_lora`` up to one rounding (the merge sums in fp32 and
rounds once, where ``fuse_lora`` rounds the delta and then the sum), but the merged
weights are read-only mappings of cache files instead of anonymous memory, and the next
start with the same adapters reads them back without merging.
"""

from __future__ import annotations

import inspect
import os

from hostmem.errors import InputError
from .adapters import Adapter, AdapterError, as_adapter

__all__ = ["PipelineComponents", "load_lora"]


class PipelineComponents(dict):
    """A pipeline's LoRA-loadable components by name, with the class whose converter reads
    adapters for them (``read_adapters`` looks for ``lora_loader``)."""

    def __init__(self, components: dict, loader):
        super().__init__(components)
        self.lora_loader = loader


def _is_pipeline(obj) -> bool:
    return hasattr(type(obj), "_lora_loadable_modules") and hasattr(type(obj), "lora_state_dict")


def _model_of(pipe_or_model, specs=()):
    """What to merge into: the pipeline's loadable components, or the model itself.

    diffusers' ``load_lora_weights`` loads a Wan 2.2 pipeline's transformer keys into its
    first expert alone (``transformer_2`` only with ``load_into_transformer_2=True``), so a
    plain call leaves the second expert out: a file of Wan's original names read by
    lora_cache's own rules means the first, not either. A file that names
    ``transformer_2.`` keys itself (``specs``) is merged into the expert it names."""
    from .adapters.diffusers_format import diffusers_loader, is_diffusers_model

    if _is_pipeline(pipe_or_model):
        names = list(type(pipe_or_model)._lora_loadable_modules)
        if "transformer_2" in names and not any(_names_component(s.path, "transformer_2") for s in specs):
            names.remove("transformer_2")
        present = {n: getattr(pipe_or_model, n, None) for n in names}
        return PipelineComponents({n: m for n, m in present.items() if m is not None}, type(pipe_or_model))
    if is_diffusers_model(pipe_or_model) and diffusers_loader(pipe_or_model) is not None:
        return pipe_or_model
    raise TypeError(
        f"lora_cache.load_lora takes a diffusers pipeline or a diffusers model diffusers loads LoRA into, "
        f"not {type(pipe_or_model).__name__}; for other models call lora_cache.merge(model, adapters, cache_root=...)"
    )


def _names_component(path, name: str) -> bool:
    """Whether the adapter file at ``path`` (a safetensors file) has keys under ``name.``."""
    from hostmem.safetensors.header import SafetensorsError, read_header

    try:
        return any(key.startswith(name + ".") for key in read_header(path).tensors)
    except (SafetensorsError, OSError, ValueError):  # a folder, a pickle: read as before, by the merge
        return False


def _specs(lora, strength: float, weight_name: str | None) -> list[Adapter]:
    """Each adapter asked for; a bare path takes ``strength`` (tuples and Adapters their own)."""
    if isinstance(lora, dict) and "path" not in lora:
        raise AdapterError(
            "lora_cache.load_lora takes adapter files, not a state dict: the cache keys merged weights by "
            "the file's content. Save the state dict with save_lora_weights and pass the folder"
        )
    items = lora if isinstance(lora, list) else [lora]
    specs = []
    for item in items:
        if isinstance(item, (str, os.PathLike)):
            path = os.fspath(item)
            if weight_name is not None and os.path.isdir(path):
                path = os.path.join(path, weight_name)
            item = Adapter(path, strength)
        specs.append(as_adapter(item))
    if not specs:
        raise AdapterError("lora_cache.load_lora: no adapter given")
    return specs


# diffusers' load_lora_weights keywords that mean nothing to a merge through the cache, and what to do instead
_DIFFUSERS_ONLY = {
    "adapter_name": "name adapters for switching with lora_cache.set_pipeline_adapters(pipe, names, weights, "
                    "files={name: path}, cache_root=...)",
    "hotswap": "switch adapters with lora_cache.set_pipeline_adapters or lora_cache.set_adapters",
}


def _check_options(merge_options: dict, merge) -> None:
    """Refuse a keyword neither ``load_lora`` nor :func:`lora_cache.merge` takes, naming it."""
    taken = [p for p in inspect.signature(merge).parameters if p not in ("model", "adapters", "cache_root")]
    for name in merge_options:
        if name not in taken:
            advice = _DIFFUSERS_ONLY.get(name, "leave it out")
            raise InputError(
                f"lora_cache.load_lora does not take the keyword {name}=; {advice}. It takes weight_name=, "
                f"load_into_transformer_2= and lora_cache.merge's options: {', '.join(taken)}"
            )


def _transformer_2(pipe):
    """The pipeline's second transformer (Wan 2.2's low-noise expert), for ``load_into_transformer_2``."""
    if not _is_pipeline(pipe):
        raise InputError(
            f"lora_cache.load_lora(..., load_into_transformer_2=True) takes a pipeline with a transformer_2 "
            f"(Wan 2.2), not {type(pipe).__name__}; to merge into a model, pass that model itself"
        )
    model = getattr(pipe, "transformer_2", None)
    if model is None:
        raise InputError(
            f"lora_cache.load_lora(..., load_into_transformer_2=True): this {type(pipe).__name__} has no "
            "transformer_2 (a Wan 2.1 pipeline has one transformer); leave load_into_transformer_2 out to merge "
            "into pipe.transformer"
        )
    return model


def load_lora(pipe_or_model, lora, strength: float = 1.0, cache_root: str | os.PathLike | None = None, *,
              weight_name: str | None = None, load_into_transformer_2: bool = False, **merge_options):
    """Merge ``lora`` into a diffusers pipeline (or model) through the cache; return the
    :class:`~lora_cache.orchestrate.MergeStats`.

    ``lora`` is a file, a folder (``weight_name`` picks the file in it, as in diffusers), a
    ``(path, strength)`` tuple, a :class:`lora_cache.Adapter`, or a list of them (merged in
    order, each with its strength). ``cache_root`` and ``merge_options`` mean what they mean
    to :func:`lora_cache.merge` (the default root, ``enabled=False`` to merge in place as
    ``fuse_lora`` does, ``base_files``, ``max_size``, ``device``, ``progress``, ...). A
    tensor-parallel rank passes ``shards={parameter name: (dim, index, count)}`` for the
    parts it holds (see :mod:`lora_cache.ranks.tp_shards`); for a pipeline, a name starts with
    its component (``"transformer.transformer_blocks.0.attn.to_q.weight"``), as it does
    in :func:`lora_cache.merge` of a dict of models. Undo
    with ``lora_cache.unmerge(pipe.transformer)`` (or the component), never with
    ``unfuse_lora``.

    ``load_into_transformer_2=True``, as in diffusers, merges the adapter's transformer
    keys into ``pipe.transformer_2`` (a Wan 2.2 pipeline's low-noise expert) and nothing
    else; undo it with ``lora_cache.unmerge(pipe.transformer_2)``. Any other keyword
    ``load_lora_weights`` takes (``adapter_name``, ``hotswap``, ...) is refused, naming it.
    """
    from .orchestrate import merge

    _check_options(merge_options, merge)
    specs = _specs(lora, strength, weight_name)
    model = _transformer_2(pipe_or_model) if load_into_transformer_2 else _model_of(pipe_or_model, specs)
    return merge(model, specs, cache_root, **merge_options)
