"""The safetensors format, below everything that reads weights: the header without the
weights and without torch (:mod:`.header`, with the dtype table in :mod:`.dtypes`), the
read-only mapping of a file's tensors (:mod:`.mapping`), and what meets a write into
those read-only pages: the library calls known to write (:mod:`.writers`) and a report
instead of a bare SIGSEGV for any other writer (:mod:`.fault_report`).

Nothing here imports the vault, the remap or anything above hostmem.
"""

from ..lazy import lazy_exports

_EXPORTS = {
    "read_header": "header",
    "SafetensorsHeader": "header",
    "TensorInfo": "header",
    "SafetensorsError": "header",
    "DTYPE_SIZES": "dtypes",
    "open_readonly": "mapping",
    "load_readonly": "mapping",
    "save_file": "mapping",
    "tensor_bytes": "mapping",
    "make_writable": "writers",
    "ReadOnlyWeightsError": "writers",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
