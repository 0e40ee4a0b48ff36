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

from .lazy import lazy_exports

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
    "open_readonly": "safetensors_map",
    "load_readonly": "safetensors_map",
    "save_file": "safetensors_map",
    "read_header": "safetensors_header",
    "SafetensorsError": "safetensors_header",
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
    "remap": "checkpoint_remap",
    "RemapReport": "checkpoint_remap",
    "Offer": "providers",
    "OfferRecord": "providers",
    "Provider": "providers",
    "HostmemError": "errors",
    "InputError": "errors",
    "make_writable": "writers",
    "ReadOnlyWeightsError": "writers",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
