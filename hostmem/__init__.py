"""hostmem: where a model's host memory really goes.

Measurement only: /proc readers, the residency classifier, the accountant, peak
tracking and the CI guard, the read-only safetensors mapping and the pinning
backends; beside the accountant the protocol every provider implements
(:class:`Provider`, :class:`Offer`), the lowest provider, checkpoint remap
(:func:`remap`), and the guards that meet writes into read-only weights
(:func:`make_writable`). No planning and no LoRA live here.

>>> import hostmem
>>> ledger = hostmem.account({"dit": dit, "text_encoder": te})   # doctest: +SKIP
>>> print(ledger.to_table())                                       # doctest: +SKIP

Names are imported on first use, so ``import hostmem`` does not import torch: the
command line, the guard and the planner start in a fraction of a second.
"""

from __future__ import annotations

from .lazy import lazy_exports, moved_modules

_EXPORTS = {
    "account": "accountant",
    "Ledger": "accountant",
    "ComponentLedger": "accountant",
    "ParameterEntry": "accountant",
    "classify_range": "residency",
    "RangeClassifier": "residency",
    "Residency": "residency_classes",
    "inspect_process": "process",
    "ProcessResidency": "process",
    "read_status": "procfs",
    "read_meminfo": "procfs",
    "read_cgroup_memory": "procfs",
    "ProcReadError": "procfs",
    "open_readonly": "safetensors.mapping",
    "load_readonly": "safetensors.mapping",
    "save_file": "safetensors.mapping",
    "read_header": "safetensors.header",
    "SafetensorsError": "safetensors.header",
    "parse_size": "units",
    "format_size": "units",
    "track_peak_anon": "peak",
    "PeakTracker": "peak",
    "PeakTrackerError": "peak",
    "run_guarded": "guard",
    "GuardResult": "guard",
    "Pinner": "pinning",
    "PinError": "pinning",
    "aggregate_processes": "host_aggregate",
    "aggregate_ranges": "host_aggregate",
    "SetResidency": "host_aggregate",
    "gather_host_ledger": "host_ledger",
    "HostLedger": "host_ledger",
    "HostGatherError": "host_ledger",
    "remap": "remapping.checkpoint",
    "RemapReport": "remapping.checkpoint",
    "Offer": "providers",
    "OfferRecord": "providers",
    "Provider": "providers",
    "HostmemError": "errors",
    "InputError": "errors",
    "make_writable": "safetensors.writers",
    "ReadOnlyWeightsError": "safetensors.writers",
    "LoraHeldElsewhereError": "safetensors.writers",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
# Old paths of modules that moved to a room of their own, still importable (the same module).
moved_modules(__name__, {
    "safetensors_header": "safetensors.header", "safetensors_map": "safetensors.mapping",
    "dtypes": "safetensors.dtypes", "writers": "safetensors.writers", "fault_report": "safetensors.fault_report",
    "checkpoint_files": "remapping.files", "checkpoint_remap": "remapping.checkpoint",
    "remap_spill": "remapping.spill", "remap_offer": "remapping.offer", "remap_origin": "remapping.origin",
    "same_bytes": "remapping.same_bytes",
})
