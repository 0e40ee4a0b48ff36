"""The safetensors format, below everything that reads weights: the header without the
weights and without torch (:mod:`.header`, with the dtype table in :mod:`.dtypes`), the
read-only mapping of a file's tensors (:mod:`.mapping`), and what meets a write into
those read-only pages: the library calls known to write (:mod:`.writers`) and a report
instead of a bare SIGSEGV for any other writer (:mod:`.fault_report`).

Nothing here imports the vault, the remap or anything above hostmem.
"""
