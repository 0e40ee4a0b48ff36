"""Modules that moved to another room keep their old import paths: the very same module.

A user's ``from lora_cache.adapter_switch import set_adapters`` (or a patch of a private
name at the old path) must keep working after the move, so the old path answers with the
new module object, not with a copy of its names.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import hostmem  # noqa: F401 (registers its moved paths)
import lora_cache  # noqa: F401 (registers its moved paths)
import planners  # noqa: F401 (registers its moved paths)

MOVED = {
    "lora_cache.switch": "lora_cache.settings",
    "lora_cache.adapter_switch": "lora_cache.switching.adapter_switch",
    "lora_cache.switch_state": "lora_cache.switching.switch_state",
    "lora_cache.diffusers_switch": "lora_cache.switching.diffusers_switch",
    "lora_cache.forward_gate": "lora_cache.switching.forward_gate",
    "lora_cache.switching.runtime_lora": "lora_cache.placement.runtime_lora",
    "lora_cache.adapters.kohya_flux": "lora_cache.adapters.kohya_flux_compat",
    "lora_cache.adapters.full_diffs": "lora_cache.adapters.diff_placement",
    "lora_cache.shared_build": "lora_cache.ranks.shared_build",
    "lora_cache.shared_faults": "lora_cache.ranks.faults",
    "lora_cache.shared_fold": "lora_cache.ranks.fold",
    "lora_cache.process_group": "lora_cache.ranks.process_group",
    "lora_cache.tp_shards": "lora_cache.ranks.tp_shards",
    "lora_cache.tp_shards.shard_math": "lora_cache.ranks.tp_shards.shard_math",
    "lora_cache.adapter_paths": "lora_cache.adapters.paths",
    "lora_cache.key_names": "lora_cache.adapters.key_names",
    "lora_cache.checkpoint_model": "lora_cache.adapters.checkpoint_model",
    "lora_cache.lycoris_math": "lora_cache.terms.lycoris_math",
    "lora_cache.dora_lycoris": "lora_cache.terms.dora_lycoris",
    "lora_cache.keys": "lora_cache.targets.keys",
    "lora_cache.header_targets": "lora_cache.targets.header_targets",
    "lora_cache.planned_conversion": "lora_cache.targets.planned_conversion",
    "lora_cache.canonical_key": "lora_cache.key.canonical_key",
    "lora_cache.combination": "lora_cache.key.combination",
    "lora_cache.base_shards": "lora_cache.key.base_shards",
    "lora_cache.merge_math": "lora_cache.compute.merge_math",
    "lora_cache.buffers": "lora_cache.compute.buffers",
    "lora_cache.layers": "lora_cache.placement.layers",
    "lora_cache.runtime_lora": "lora_cache.placement.runtime_lora",
    "lora_cache.rounding": "lora_cache.placement.rounding",
    "lora_cache.rounding_memo": "lora_cache.placement.rounding_memo",
    "planners.executor.roles": "planners.layer_roles",
    "planners.executor.tier": "planners.executor_tier",
    "planners.executor.calibration": "planners.calibration",
    "planners.executor.guard": "planners.offload_hooks",
    "hostmem.safetensors_header": "hostmem.safetensors.header",
    "hostmem.safetensors_map": "hostmem.safetensors.mapping",
    "hostmem.dtypes": "hostmem.safetensors.dtypes",
    "hostmem.writers": "hostmem.safetensors.writers",
    "hostmem.fault_report": "hostmem.safetensors.fault_report",
    "hostmem.checkpoint_files": "hostmem.remapping.files",
    "hostmem.checkpoint_remap": "hostmem.remapping.checkpoint",
    "hostmem.remap_spill": "hostmem.remapping.spill",
    "hostmem.remap_offer": "hostmem.remapping.offer",
    "hostmem.remap_origin": "hostmem.remapping.origin",
    "hostmem.same_bytes": "hostmem.remapping.same_bytes",
}


@pytest.mark.parametrize("old,new", sorted(MOVED.items()))
def test_an_old_path_is_the_new_module(old, new):
    assert importlib.import_module(old) is importlib.import_module(new)
    # and it keeps its own spec: a function-local relative import in it resolves in its new
    # room, without ImportWarning (__package__ != __spec__.parent)
    assert importlib.import_module(new).__spec__.name == new


def test_a_fresh_process_imports_by_the_old_path():
    """``from OLD import name`` as the first import of a process, before the package is loaded."""
    code = ("from lora_cache.switch import DISABLE_ENV, cache_disabled_by_env\n"
            "import lora_cache.settings as s\n"
            "assert cache_disabled_by_env is s.cache_disabled_by_env, 'a copy, not the module'\n"
            "print(DISABLE_ENV)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "HOSTMEM_DISABLE_LORA_MERGE_CACHE"


def test_the_face_still_serves_the_function_remap_beside_the_room_remapping():
    """``hostmem.remap`` is the function, before and after the room is imported."""
    importlib.import_module("hostmem.remapping.checkpoint")
    assert callable(hostmem.remap) and hostmem.remap.__module__ == "hostmem.remapping.checkpoint"


def test_an_unknown_path_still_fails():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("lora_cache.no_such_room")
