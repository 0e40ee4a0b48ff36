"""A checkpoint mapped as a tree of parameters, read by the adapters' reader as the server's
diffusers model will be.

``hostmem lora merge`` builds a cache without the model's class: the checkpoint's tensors
become parameters of a module tree named like them (:func:`lora_cache.placement.layers.checkpoint_module`).
Read against that tree, an adapter went through this package's own reader, while the
server's ``load_lora`` (of a pipeline or a model), ``merge`` and ``set_adapters`` of the
diffusers model read it through diffusers' converter for the model's class
(:mod:`lora_cache.adapters.for_model`): two readings, two canonical forms, two keys, and
files only diffusers' converter maps (a musubi Wan file, a kohya Flux file) were refused
by the build. :func:`served_as` makes the tree read as the server's model is: the class
the checkpoint folder's ``config.json`` names (``_class_name``), its config (what the
converters and the single-file converter of full diffs look at: a UNet's
``layers_per_block`` maps kohya SDXL's SGM block names) and the loader mixin whose
converter diffusers uses for it. Where diffusers is missing or loads no LoRA into the
class, the tree stays as it is (this package's reader, as a server of another model).
"""

from __future__ import annotations

__all__ = ["served_as"]


def served_as(tree, class_name: str | None, config: dict | None):
    """``tree`` (a checkpoint's module tree) read by adapters as a ``class_name`` diffusers model
    with ``config`` would be; the tree itself, changed in place, is returned."""
    if not class_name or config is None:
        return tree
    try:
        from diffusers.configuration_utils import FrozenDict

        from .diffusers_format import diffusers_loader
    except ImportError:  # diffusers is an optional extra: without it the server reads as this package does
        return tree
    tree.__class__ = type(class_name, (type(tree),), {"__doc__": f"A mapped checkpoint of a {class_name}."})
    loader = diffusers_loader(tree)
    if loader is None:
        tree.__class__ = tree.__class__.__mro__[1]
        return tree
    tree.config = FrozenDict(config)
    tree.lora_loader = loader
    return tree
