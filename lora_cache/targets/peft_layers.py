"""A model that already holds peft's LoRA layers (diffusers' ``load_lora_weights``, fused or
not) is refused before any adapter key is resolved.

peft moves each Linear it targets to ``<name>.base_layer``, so every key of a lora_cache
adapter would match no module, and the merge would say so with advice about key rules
that cannot help. The layers are found as the foreign-writer guard finds them
(:func:`hostmem.safetensors.writers.tuner_layers`), and the refusal names them, the
adapters they hold, and the two ways out.
"""

from __future__ import annotations

from hostmem.errors import InputError
from hostmem.safetensors.writers import tuner_layers

from .layer_target import components_of

__all__ = ["refuse_peft_layers"]


def _adapters(layer) -> list[str]:
    """The adapter names a peft layer holds, each marked ``(fused)`` where it is merged."""
    merged = set(getattr(layer, "merged_adapters", ()) or ())
    names = list(getattr(layer, "lora_A", {}) or ()) or list(getattr(layer, "active_adapters", ()) or ())
    return [f"{name!r}{' (fused)' if name in merged else ''}" for name in names]


def refuse_peft_layers(model) -> None:
    """Raise :class:`~hostmem.errors.InputError` if any component of ``model`` holds peft tuner layers."""
    found = {}
    for component, root in components_of(model).items():
        layers = [(".".join(p for p in (component, name) if p), layer) for name, layer in tuner_layers(root)]
        if layers:
            found[component or type(root).__name__] = layers
    if not found:
        return
    parts = []
    for component, layers in found.items():
        adapters = sorted({a for _, layer in layers for a in _adapters(layer)})
        names = ", ".join(name for name, _ in layers[:3]) + (", ..." if len(layers) > 3 else "")
        parts.append(f"{component}: {len(layers)} layer(s) ({names}), adapter(s) {', '.join(adapters) or 'unnamed'}")
    raise InputError(
        "lora_cache: the model holds diffusers/peft LoRA layers, which lora_cache does not merge beside ("
        + "; ".join(parts) + "). Take them off first (pipe.unfuse_lora(); pipe.unload_lora_weights(), or for a "
        "peft model model.unload()), or load every adapter through lora_cache "
        "(lora_cache.load_lora(pipe, [(path, strength), ...]) or lora_cache.set_pipeline_adapters)"
    )
