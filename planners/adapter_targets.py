"""LoRA targets read from the adapters' and the checkpoint's headers, before loading.

A config that gives the merged component by path need not declare ``lora_targets``:
the adapter files say which modules they change, and the checkpoint's headers say
how many bytes each of those weights holds. The names are resolved by the same code
the merge runs (:func:`lora_cache.provider.target_layers`, through the one resolver of
:mod:`lora_cache.adapters.key_names`), so ``--what-if in-place`` predicts the bytes a merge will
actually write. The common layouts are read from the adapters' headers without torch;
an adapter only the full reader can take (a peft config asking for DoRA, a rule on rows
of a fused weight, a malformed key) is read with torch, and the plan says so. For a
diffusers model (its folder's config.json names the class), a file only diffusers'
converter maps is read as the merge reads it: from the conversion record a merge left
under the config's cache roots (no torch), else by the converter (torch, said in a note).
"""

from __future__ import annotations

import os

from .config import AdapterConfig, DeploymentConfig
from .sizes import ComponentSizes, layer_matcher

__all__ = ["adapter_spec", "check_adapter_files", "with_adapter_targets"]


def adapter_spec(adapter: AdapterConfig) -> dict:
    """The config's adapter as the dict ``lora_cache.as_adapter`` takes."""
    spec = {"path": adapter.path, "strength": adapter.strength, "rules": list(adapter.rules),
            "strict": adapter.strict}
    if adapter.alpha is not None:
        spec["alpha"] = adapter.alpha
    if adapter.rslora is not None:
        spec["rslora"] = adapter.rslora
    return spec


def check_adapter_files(config: DeploymentConfig) -> None:
    """Raise a ConfigError naming ``lora.adapters[N].path`` and its line for a missing file."""
    for i, adapter in enumerate(config.lora.adapters if config.lora else ()):
        if not os.path.exists(adapter.path):
            raise config.origin.error(
                f"lora.adapters[{i}].path",
                f"{adapter.path}: no such adapter file; fix the path (relative paths start at the "
                "config's folder), or declare lora_targets on the merged component to plan without it",
            )


def with_adapter_targets(config: DeploymentConfig, sizes: ComponentSizes, path: str, pattern: str | None,
                         headers: list | None = None) -> ComponentSizes:
    """``sizes`` with each layer's LoRA target bytes: the weights the adapters change.
    ``headers``: the checkpoint's, as :func:`planners.checkpoint.read_headers` gave them
    (read here when not given)."""
    from lora_cache.provider import target_layers

    from .checkpoint import diffusers_class, read_headers  # here: ``hostmem plan`` imports this module for its check

    check_adapter_files(config)
    headers = read_headers(path) if headers is None else headers
    shards = [header.path for header in headers]
    cache = config.lora.cache
    roots = (cache.roots or None) if cache is None or cache.enabled else ()  # the merge's roots (None: the default)
    found = target_layers(shards, [adapter_spec(a) for a in config.lora.adapters], model_class=diffusers_class(path),
                          memo_roots=roots, headers=headers)
    if found.read_with_torch:
        sizes = sizes._replace(notes=(*sizes.notes, f"the LoRA targets of {sizes.name} were read with torch (a slower "
                                                    f"plan, the same figures): {found.read_with_torch}"))
    if found.converted:
        sizes = sizes._replace(notes=(*sizes.notes, f"the LoRA targets of {sizes.name} were read {found.converted}"))
    if not found.names:
        return sizes
    nbytes = {name: info.nbytes for header in headers for name, info in header.tensors.items()}
    match = layer_matcher(pattern) if pattern else (lambda name: None)
    per_layer: dict[str, int] = {}
    for name in found.names:
        layer = match(name)
        key = layer[1] if layer else None
        per_layer[key] = per_layer.get(key, 0) + nbytes[name]
    layers = tuple(u._replace(lora_target_bytes=per_layer.get(u.name, 0)) for u in sizes.layers)
    rest = sizes.rest
    if rest is not None:
        rest = rest._replace(lora_target_bytes=per_layer.get(None, 0))
    return sizes._replace(layers=layers, rest=rest)
