"""One demo scenario, run in a process of its own: load, merge (or not), account, plan.

``python -m planners.demo.scenario CONFIG NAME OUT.json`` where NAME is one of
:data:`SCENARIOS`. What a server does at start-up, and nothing more, so the parent's
peak tracker sees exactly a start's anonymous memory:

- ``base``: the DiT and text encoder mapped read-only, no LoRA;
- ``in_place``: the DiT loaded as servers load it (safetensors' private writable
  mapping) and the adapter merged in place, the cache off, able to unmerge: the merged
  layers are anonymous memory (the untouched base is the unmerge copy);
- ``cached_miss`` / ``cached_hit``: mapped read-only, merged through the cache (the
  first start builds it, the second finds it).
"""

from __future__ import annotations

import json
import sys
import time

SCENARIOS = ("base", "in_place", "cached_miss", "cached_hit")


def _load(paths: list[str], readonly: bool):
    """A module tree over the checkpoint: read-only mapped, or safetensors' own mapping."""
    from lora_cache.placement.layers import checkpoint_module, module_tree

    if readonly:
        return checkpoint_module(paths)
    from safetensors import safe_open

    def tensors():
        for path in paths:
            with safe_open(path, "pt") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)

    return module_tree(tensors())


def _first_request(*modules) -> None:
    """Read every weight once, as the first request streams each layer to the device."""
    import torch

    with torch.no_grad():
        for module in modules:
            for tensor in module.parameters():
                flat = tensor.detach().reshape(-1).view(torch.uint8)
                float(flat[::4096].sum())  # one byte per page faults the whole page in


def run(config_path: str, name: str) -> dict:
    """Start the way scenario ``name`` starts and return its figures (bytes, seconds)."""
    started = time.perf_counter()
    import lora_cache
    from hostmem.procfs import read_status
    from planners.checkpoint import checkpoint_files
    from planners.config import load_config
    from planners.report import report_dict, report_text
    from planners.startup import plan_loaded

    config = load_config(config_path)
    dit_files = checkpoint_files(config.components["dit"].path)
    te_files = checkpoint_files(config.components["text_encoder"].path)
    dit = _load(dit_files, readonly=name != "in_place")
    text_encoder = _load(te_files, readonly=True)
    stats = None
    if name != "base":
        adapters = [(a.path, a.strength) for a in config.lora.adapters]
        # In place, able to unmerge (what the planner's --what-if in-place predicts); the
        # cache is asked off, not merely left unnamed.
        in_place = name == "in_place"
        stats = lora_cache.merge(dit, adapters, cache_root=None if in_place else config.lora.cache.root,
                                 enabled=not in_place, unmergeable=in_place, base_files=dit_files, progress=False)
    _first_request(dit, text_encoder)
    plan = plan_loaded(config, {"dit": dit, "text_encoder": text_encoder}, merge_stats=stats, quiet=True)
    start_s = time.perf_counter() - started
    report = report_dict(plan)
    components = report["components"]
    return {
        "name": name,
        "final_anon_bytes": read_status().rss_anon,
        "file_backed_bytes": sum(c["file_backed"] for c in components.values()),
        "budget_bytes": report["budget"]["bytes"],
        "pinned_bytes": {c: p["pinned_bytes"] for c, p in report["pin_plans"].items()},
        "merged_layers_computed": 0 if stats is None else stats.built + stats.in_place + stats.fallen_back,
        "merge": None if stats is None else stats.to_dict(),
        "start_s": start_s,
        "report": report,
        "report_text": report_text(plan),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] not in SCENARIOS:
        print(f"usage: python -m planners.demo.scenario CONFIG {{{','.join(SCENARIOS)}}} OUT.json", file=sys.stderr)
        return 2
    result = run(argv[0], argv[1])
    with open(argv[2], "w") as handle:
        json.dump(result, handle)
    return 0


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    sys.exit(main(sys.argv[1:]))
