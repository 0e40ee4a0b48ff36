"""What-if residency: where a component's bytes will live, before it is loaded.

Residency follows from declared behaviour, not from measurement:

- ``load: mapped`` (read-only views into the checkpoint): every byte is file-backed;
- ``load: copied`` (weights read or cast into process memory): every byte is anonymous;
- an ``in-place`` LoRA merge turns the merged target weights anonymous; over weights
  loaded ``copied`` (the process's own memory, summed where they lie) it also keeps an
  unmerge snapshot of the originals (anonymous too, held outside the weights), where
  over ``mapped`` ones each merged weight is a new tensor and the mapped base, never
  written, is its own snapshot;
- a ``cached`` merge maps the merged weights back read-only from the cache file, so
  the targets stay file-backed and no snapshot is needed (the base stays mapped).
"""

from __future__ import annotations

from hostmem.errors import InputError
from hostmem.residency_classes import Residency
from lora_cache.settings import DISABLE_ENV, cache_disabled_by_env

from .config import ComponentConfig, DeploymentConfig
from .sizes import ComponentSizes, Layer, from_declared, layer_matcher

__all__ = [
    "MERGE_MODES",
    "default_merge",
    "merge_reason",
    "predict",
    "component_sizes",
    "checkpoint_sizes",
    "what_if_components",
    "in_place_merge_bytes",
]

MERGE_MODES = ("none", "in-place", "cached")


def default_merge(config: DeploymentConfig) -> str:
    """The merge a deployment does: none without adapters, else cached if the cache is on.

    The cache is off when the config says so (``lora.cache.enabled: false``) and also
    when ``HOSTMEM_DISABLE_LORA_MERGE_CACHE=1`` is set: ``lora_cache.merge`` then merges
    in place whatever the config says, so the plan must predict that too.
    """
    lora = config.lora
    if lora is None or not lora.adapters or config.merge_target is None:
        return "none"
    return "cached" if lora.cache.enabled and not cache_disabled_by_env() else "in-place"


def merge_reason(config: DeploymentConfig) -> str:
    """One line for the report: why :func:`default_merge` chose what it chose."""
    lora = config.lora
    if lora is None or not lora.adapters:
        return ""
    if config.merge_target is None:
        return "no component declares lora_targets, so the adapters change nothing the plan can see"
    if not lora.cache.enabled:
        return (f"lora.cache.enabled is false ({config.origin.where('lora.cache.enabled')}): merged weights "
                "are anonymous memory; set it to true to merge through the cache")
    if cache_disabled_by_env():
        return (f"{DISABLE_ENV}=1 turns the LoRA merge cache off, so a server merges in place "
                "(merged weights anonymous) although lora.cache is enabled "
                f"({config.origin.where('lora.cache')}); unset it to merge through the cache")
    root = lora.cache.root or "~/.cache/hostmem"
    return (f"lora.cache is enabled ({config.origin.where('lora.cache')}): merged weights are written once "
            f"under {root} and mapped back read-only, so they stay file-backed")


def _predicted(unit: Layer, load: str, merge: str) -> Layer:
    """The unit once loaded and merged: its residency built once, from ``nbytes``.

    Loading decides every byte (mapped: file-backed, but for the bytes cast to another
    dtype at load; copied: anonymous), whatever the unit's residency was; an in-place
    merge then turns its targets anonymous, a cached one file-backed.
    """
    anonymous = unit.cast_bytes if load == "mapped" else unit.nbytes  # a cast is a copy, never a view
    file_backed = unit.nbytes - anonymous
    moved = unit.lora_target_bytes
    if merge == "in-place":
        take = min(moved, file_backed)
        file_backed, anonymous = file_backed - take, anonymous + take
    elif merge == "cached":
        take = min(moved, anonymous)
        anonymous, file_backed = anonymous - take, file_backed + take
    return unit._replace(residency=Residency(anonymous=anonymous, file_backed=file_backed))


def predict(sizes: ComponentSizes, load: str, merge: str = "none") -> ComponentSizes:
    """Return ``sizes`` with the residency that ``load`` and ``merge`` will give it."""
    if merge not in MERGE_MODES:
        raise InputError(f"merge {merge!r}: choose one of {', '.join(MERGE_MODES)}")
    units = [_predicted(u, load, merge) for u in sizes.units]
    snapshot = merge == "in-place" and load == "copied"  # see the module docstring
    extra = Residency(anonymous=sizes.lora_target_bytes) if snapshot else Residency()
    return sizes.with_units(units)._replace(extra=extra)


def component_sizes(config: DeploymentConfig, component: ComponentConfig) -> ComponentSizes:
    """Sizes of ``component`` from its checkpoint's headers or its declared sizes."""
    if component.path is None:
        return from_declared(
            component.name, component.offload, component.size, component.layer_count,
            component.lora_target_bytes, component.dtype,
        )
    from .checkpoint import read_checkpoint, read_headers  # here: declared sizes read no header

    headers = read_headers(component.path, component.variant)  # once: the sizes and the adapters' targets both read them
    sizes = read_checkpoint(
        component.name, component.offload, component.path, component.layer_pattern,
        component.lora_target_patterns, component.lora_target_bytes, component.dtype, headers=headers,
    )
    key = f"components.{component.name}"
    if _targets_from_adapters(config, component):
        from .adapter_targets import with_adapter_targets

        sizes = with_adapter_targets(config, sizes, component.path, component.layer_pattern, headers)
    for pattern in _unmatched(component.layer_pattern, sizes):
        raise config.origin.error(
            f"{key}.layers",
            f"{pattern!r} matches no tensor of {component.path}; "
            f"write the prefix its block tensors share, e.g. \"blocks.{{i}}.\"",
        )
    if component.lora_target_bytes and component.lora_target_bytes > sizes.weights_bytes:
        raise config.origin.error(f"{key}.lora_targets", "exceeds the checkpoint's size; lower it")
    if component.lora_target_patterns and not sizes.lora_target_bytes:
        raise config.origin.error(f"{key}.lora_targets", f"{list(component.lora_target_patterns)} match no tensor")
    return sizes


def _unmatched(pattern, sizes: ComponentSizes) -> list[str]:
    """The block patterns (one, or each of a list) that name no block of ``sizes``."""
    if not pattern:
        return []
    patterns = (pattern,) if isinstance(pattern, str) else pattern
    names = [layer.name + "." for layer in sizes.layers]
    return [p for p in patterns if not any(layer_matcher(p)(n) or layer_matcher(p)(n[:-1]) for n in names)]


def _targets_from_adapters(config: DeploymentConfig, component: ComponentConfig) -> bool:
    """True for the merged component given by path without declared ``lora_targets``."""
    target = config.merge_target
    return (target is not None and target.name == component.name and not component.has_lora_targets
            and config.lora is not None and bool(config.lora.adapters))


def checkpoint_sizes(config: DeploymentConfig) -> dict[str, ComponentSizes]:
    """Every component's sizes (headers or declared), before any residency is predicted."""
    return {c.name: component_sizes(config, c) for c in config.components.values()}


def what_if_components(
    config: DeploymentConfig, merge: str, sizes: dict[str, ComponentSizes] | None = None
) -> tuple[dict[str, ComponentSizes], list[str]]:
    """Every component's sizes with predicted residency, and warnings about the merge.

    ``sizes`` (from :func:`checkpoint_sizes`) saves reading the headers again when the
    same deployment is predicted under more than one merge.
    """
    if sizes is None:
        sizes = checkpoint_sizes(config)
    warnings: list[str] = []
    target = config.merge_target
    if merge != "none" and (target is None or not sizes[target.name].lora_target_bytes):
        warnings.append(
            f"merge {merge} asked for, but no component has LoRA targets: nothing is merged; "
            "list the adapters under lora.adapters with the merged component given by path, or "
            "declare lora_targets (a size, or tensor name patterns) on it"
        )
    warnings += [note for c in config.components.values() for note in sizes[c.name].notes]
    out = {}
    for component in config.components.values():
        this_merge = merge if target is not None and component.name == target.name else "none"
        out[component.name] = predict(sizes[component.name], component.load, this_merge)
    return out, warnings



def in_place_merge_bytes(config: DeploymentConfig, sizes: dict[str, ComponentSizes]) -> int:
    """Non-reclaimable bytes the in-place merge commits beyond the cached one: one price.

    Computed from the two predictions themselves (:func:`predict`), so the budget of an
    in-place plan, the LoRA cache's offer and the comparison of a cached plan with the
    in-place one all read the same figure: the merged targets over mapped weights (the
    base is its own snapshot), the targets and their unmerge snapshot over copied ones.
    """
    target = config.merge_target
    if target is None:
        return 0
    load = config.components[target.name].load
    in_place = predict(sizes[target.name], load, "in-place").residency.non_reclaimable
    cached = predict(sizes[target.name], load, "cached").residency.non_reclaimable
    return max(0, in_place - cached)
