"""Adapter files of the formats people ship, read into one normalized form.

Every format names the same few parts of a module's change with its own suffixes:

- peft: ``base_model.model.<module>.lora_A.weight`` (down) and ``.lora_B.weight`` (up),
  rank and alpha from ``adapter_config.json`` beside it (``r``, ``lora_alpha``,
  ``rank_pattern``, ``alpha_pattern``, ``use_rslora``);
- diffusers: ``transformer.<module>.lora_A.weight`` / ``.lora_B.weight``, with or
  without its adapter metadata (``lora_adapter_metadata`` in the header, the same fields
  per component), or ``.alpha`` keys (network alphas);
- kohya / sd-scripts: ``lora_unet_<module_with_underscores>.lora_down.weight``,
  ``.lora_up.weight`` and ``.alpha`` (``ss_network_alpha`` in the header is a record, not an alpha);
- ComfyUI / lightx2v: ``diffusion_model.<module>.lora_down.weight``, ``.lora_up.weight``,
  ``.alpha``, and full deltas ``.diff`` (weight) and ``.diff_b`` (bias);
- ai-toolkit: ``diffusion_model.<module>.lora_A/B.weight``, one alpha in the header
  (``alpha``, ``lora_alpha`` or ``network_alpha``);
- XLabs ``.down.weight`` / ``.up.weight``, peft's ``.lora_A.default.weight`` infix.

Each format is one module of :mod:`lora_cache.adapters.formats`, tried from one list
there (its key suffixes, how it is recognised, how it is read).

A path may be the file or the folder peft (``adapter_model.safetensors``) or diffusers
(``pytorch_lora_weights.safetensors``) wrote; an ``adapter_config.json`` belongs to the
file peft wrote with it only. Alpha precedence, and what happens when two places
disagree, is in :mod:`lora_cache.adapters.alpha`; where a converter folds alphas into
the factors, :mod:`lora_cache.adapters.alpha_fold` keeps each applied once. Every key is
used or named (:mod:`lora_cache.adapters.accounting`), full diffs included
(:mod:`lora_cache.adapters.diff_placement`). For a diffusers model the keys
are converted by diffusers itself (:mod:`lora_cache.adapters.diffusers_format`), each
conversion recorded by the file's content so that a start whose layers are all cached
does not convert again (:mod:`lora_cache.adapters.conversion_memo`); a kohya Flux file
whose sizes diffusers' converter cannot take is read by this package's parser
(:mod:`lora_cache.adapters.formats.kohya_flux`). Which file a path names is
:mod:`lora_cache.adapters.paths`; which module a key's stem names, by names alone,
:mod:`lora_cache.adapters.key_names` (the tensors are laid on the model's parameters in
:mod:`lora_cache.targets`); :mod:`lora_cache.adapters.checkpoint_model` reads a mapped
checkpoint as the server's diffusers model will be read.
"""

from __future__ import annotations

from hostmem.lazy import lazy_exports

_EXPORTS = {  # imported on first use: the planner reads formats' key suffixes without torch
    "Adapter": "spec",
    "AdapterError": "spec",
    "AdapterFile": "read",
    "AlphaSources": "alpha",
    "ModuleChange": "read",
    "PeftConfig": "alpha",
    "as_adapter": "spec",
    "as_adapters": "spec",
    "forget_checked": "checks",
    "read_adapter": "read",
    "read_adapters": "for_model",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
