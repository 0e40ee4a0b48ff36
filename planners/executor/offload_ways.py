"""The other ways to run a model larger than host memory, applied to the synthetic model.

For ``bench/bench_offloading.py`` (through :mod:`planners.executor.trial`'s modes), so that
the executor is compared on the same model, in the same memory cgroup, with what users
reach for otherwise:

- ``group``: diffusers' group offloading at block level (one block per group). On a
  host without an accelerator the onload device is the CPU, so only its disk variant
  (``offload_to_disk_path``) keeps a model larger than host memory off anonymous memory:
  it writes each group to a safetensors file of its own at setup, loads the group's file
  (``safetensors.torch.load_file``: a private mapping) before the group's forward and
  drops it after.
- ``disk``: accelerate's ``disk_offload``: every weight written to a numpy memmap in a
  folder at setup, then each module's weights copied out of the memmap (``torch.tensor``)
  for its forward and set back to the meta device after.
- ``whole``: the whole model as anonymous memory, what model CPU offload keeps on the host
  (``enable_model_cpu_offload`` moves whole components between the host and the device:
  every weight a host copy). Made after the child joins its group: there it is killed.

Each way's copies on disk are its own (the folder given); their page cache is dropped
after setup, so the passes read them from the disk as a fresh start would.
"""

from __future__ import annotations

import importlib
import os

import torch

__all__ = ["WAYS", "apply_way", "load_whole", "drop_folder_cache"]

WAYS = ("group", "disk", "whole")


def apply_way(way: str, model: torch.nn.Module, folder: str) -> None:
    """Set ``model`` up for ``way`` (before the passes), with its copies on disk under ``folder``;
    ``whole`` needs nothing here (:func:`load_whole` runs inside the group)."""
    cpu = torch.device("cpu")
    if way == "group":
        from diffusers.hooks import apply_group_offloading

        apply_group_offloading(model, onload_device=cpu, offload_device=cpu, offload_type="block_level",
                               num_blocks_per_group=1, offload_to_disk_path=folder)
    elif way == "disk":
        # accelerate's hooks import torch._dynamo at their first forward (torch.compiler.disable): some
        # 70 MiB of the interpreter's own, imported here, as a server's earlier requests would have
        importlib.import_module("torch._dynamo")
        from accelerate import disk_offload

        disk_offload(model, folder, execution_device=cpu)
    elif way != "whole":
        raise ValueError(f"way {way!r}: one of {', '.join(WAYS)}")


def load_whole(model: torch.nn.Module) -> None:
    """Replace every weight of ``model`` by an anonymous copy of it (touched: charged where it runs)."""
    model.load_state_dict({name: value.clone() for name, value in model.state_dict().items()}, assign=True)


def drop_folder_cache(folder: str) -> int:
    """Write back and drop the page cache of every file under ``folder``; returns the bytes of those files."""
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total
