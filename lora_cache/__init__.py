"""lora_cache: LoRA-merged weights as read-only file mappings, cached across starts.

An in-place LoRA merge turns every merged layer into anonymous memory, and its unmerge
snapshot doubles that. :func:`merge` instead writes each merged layer once into a cache
folder and installs a read-only mapped view of it, so the merged weights stay page cache
the kernel can drop, and a later start with the same base and adapters reads them back
without merging::

    import lora_cache
    from hostmem import load_readonly

    stats = lora_cache.merge(dit, [("turbo.safetensors", 1.0)], cache_root="~/.cache/hostmem")
    print(stats)                 # layers hit, built, fallen back; bytes; seconds
    lora_cache.unmerge(dit)      # back to the base, bit for bit

Without ``cache_root`` the default root is used (``$HOSTMEM_CACHE_ROOT``, else
``~/.cache/hostmem``); ``enabled=False`` or ``HOSTMEM_DISABLE_LORA_MERGE_CACHE=1`` merge in
place, as servers always have, and the stats say so. :class:`Adapter` gives alpha overrides and key rules.

The merge's stages, in the order a layer goes through them, each in its room. A stage's
room imports only its own stage's rooms and earlier ones; :mod:`.orchestrate` calls them in
this order (``merge``), and the layer loop (:mod:`.layer_loop`) runs 4 to 6 per layer:

1. read the adapters into the canonical form: the files, :mod:`.adapters`; the terms each
   change is read into, with their final scale, :mod:`.terms`; those terms laid on the
   model's parameters, :mod:`.targets`;
2. make the combination's key (adapters' meaning and strengths, the base's shards, the
   policy the build hands it): :mod:`.key`;
3. open the combination: a hit, a shared build of a host's ranks (:mod:`.ranks`) or a
   build, decided in :mod:`.orchestrate`;
4. build layer by layer: the math, :mod:`.compute`; which kernel sums each shape here,
   :mod:`.kernels`;
5. seal: the vault's session (:mod:`hostmem.vault`) makes the combination durable, behind
   the start where the layers are in the page cache (:func:`wait_sealed` waits for it);
6. place the weights (mapped, run-time terms, in place): :mod:`.placement`.

Beside them: :mod:`.diffusers_entry` (``load_lora``), :mod:`.switching` (swapping placed
combinations while a server runs), :mod:`.provider` (the planner's offer) and
:mod:`.settings` (the kill switch).
"""

from hostmem.lazy import lazy_exports, moved_modules

_EXPORTS = {
    "merge": "orchestrate",
    "MergeStats": "orchestrate",
    "CacheBuildError": "orchestrate",
    "wait_sealed": "orchestrate",
    "unmerge": "switching.adapter_switch",
    "is_merged": "placement.layers",
    "UnmergeError": "placement.layers",
    "Adapter": "adapters",
    "read_adapter": "adapters",
    "AdapterError": "adapters",
    "KeyResolutionError": "targets.keys",
    "load_lora": "diffusers_entry",
    "UnsupportedAdapterError": "compute.merge_math",
    "set_adapters": "switching.adapter_switch",
    "swap_ready": "switching.adapter_switch",
    "set_pipeline_adapters": "switching.diffusers_switch",
    "Shard": "ranks.tp_shards",
    "ShardSpecError": "ranks.tp_shards",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
# Old paths of modules that moved to another room, still importable (the same module).
moved_modules(__name__, {
    "switch": "settings",
    **{name: f"switching.{name}" for name in
       ("adapter_switch", "switch_state", "diffusers_switch", "forward_gate")},
    "adapters.kohya_flux": "adapters.kohya_flux_compat",  # the format is adapters.formats.kohya_flux
    "adapters.full_diffs": "adapters.diff_placement",  # the format is adapters.formats.full_diffs
    "switching.runtime_lora": "placement.runtime_lora",  # below the merge and the switching, which both use it
    # the ranks' work, one room: a build shared by a host's ranks, tensor-parallel parts
    "shared_build": "ranks.shared_build", "shared_faults": "ranks.faults", "shared_fold": "ranks.fold",
    "process_group": "ranks.process_group", "tp_shards": "ranks.tp_shards",
    **{f"tp_shards.{name}": f"ranks.tp_shards.{name}" for name in ("spec", "plan", "full_base", "shard_math")},
    # the merge's stages, each in its room (read, key, build, place)
    "adapter_paths": "adapters.paths", "key_names": "adapters.key_names",
    "checkpoint_model": "adapters.checkpoint_model",
    "lycoris_math": "terms.lycoris_math", "dora_lycoris": "terms.dora_lycoris",
    "keys": "targets.keys", "header_targets": "targets.header_targets",
    "planned_conversion": "targets.planned_conversion",
    "canonical_key": "key.canonical_key", "combination": "key.combination", "base_shards": "key.base_shards",
    "merge_math": "compute.merge_math", "buffers": "compute.buffers",
    **{name: f"placement.{name}" for name in ("layers", "runtime_lora", "rounding", "rounding_memo")},
})
