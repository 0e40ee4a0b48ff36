"""hostmem: where a model's host memory really goes.

Measurement only: /proc readers, the residency classifier, the accountant, peak
tracking and the CI guard, the read-only safetensors mapping and the pinning
backends. No planning and no LoRA live here.

>>> import hostmem
>>> ledger = hostmem.account({"dit": dit, "text_encoder": te})   # doctest: +SKIP
>>> print(ledger.to_table())                                       # doctest: +SKIP
"""

from .accountant import ComponentLedger, Ledger, ParameterEntry, account
from .guard import GuardResult, run_guarded
from .peak import PeakTracker, PeakTrackerError, track_peak_anon
from .process import ProcessResidency, inspect_process
from .procfs import ProcReadError, read_cgroup_memory, read_meminfo, read_status
from .residency import RangeClassifier, Residency, classify_range
from .safetensors_map import SafetensorsError, load_readonly, open_readonly, read_header
from .units import format_size, parse_size

__all__ = [
    "account",
    "Ledger",
    "ComponentLedger",
    "ParameterEntry",
    "classify_range",
    "RangeClassifier",
    "Residency",
    "inspect_process",
    "ProcessResidency",
    "read_status",
    "read_meminfo",
    "read_cgroup_memory",
    "ProcReadError",
    "open_readonly",
    "load_readonly",
    "read_header",
    "SafetensorsError",
    "parse_size",
    "format_size",
    "track_peak_anon",
    "PeakTracker",
    "PeakTrackerError",
    "run_guarded",
    "GuardResult",
]
