"""Unified-memory hosts: where the GPU's memory is host memory.

On an integrated GPU (DGX Spark's GB10, Jetson) the device has no memory of its own:
what it allocates comes out of the RAM ``/proc/meminfo`` counts. On Grace Hopper and
Grace Blackwell the GPU's memory is on line as host memory, a NUMA node with memory
and no CPU, inside MemTotal. Either way the weights a plan keeps on the device, its
prefetch window and its reserve are host memory too: counted once, against the host
limit (:mod:`planners.budget`), never as a second pool beside it. A pinned layer stays
one host copy the device reads; it is counted once, in the pins.

What is read, in order, each named as the source in the report:

- torch's own answer, ``get_device_properties(i).is_integrated``, where this process
  has torch with CUDA initialised already (never imported for this);
- the device tree of a Jetson (``/proc/device-tree/compatible`` naming ``nvidia,tegra``);
- NUMA nodes with memory and no CPU (``/sys/devices/system/node/has_memory`` less
  ``has_cpu``) on an aarch64 host with an NVIDIA GPU (``/proc/driver/nvidia/gpus``):
  Grace's GPU memory; on x86 such nodes are CXL or persistent memory, so not taken;
- the model in ``/proc/driver/nvidia/gpus/*/information`` of a GPU NVIDIA ships only
  integrated (GB10), which reports no frame buffer.

:func:`unified_memory_at` reads the files under a root folder, so tests lay out the
files of such a machine and read them through the same code.
"""

from __future__ import annotations

import os
import sys
from typing import NamedTuple

from hostmem.units import format_size

__all__ = ["UnifiedMemory", "read_unified_memory", "unified_memory_at"]

# GPUs NVIDIA makes only as an integrated part: their model name says it all.
_INTEGRATED_MODELS = ("GB10",)


class UnifiedMemory(NamedTuple):
    """Whether the device's memory is host memory, and the fact that says so (or why not)."""

    unified: bool
    source: str


def read_unified_memory() -> UnifiedMemory:
    """This machine, read now: torch's answer where it is loaded with CUDA, else the files."""
    said = _torch_says()
    return said if said is not None else unified_memory_at("/", os.uname().machine)


def _torch_says() -> UnifiedMemory | None:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    count = torch.cuda.device_count()
    integrated = [i for i in range(count) if torch.cuda.get_device_properties(i).is_integrated]
    if integrated:
        return UnifiedMemory(True, f"torch.cuda: device {integrated[0]} is integrated")
    return UnifiedMemory(False, f"torch.cuda: none of {count} devices is integrated")


def unified_memory_at(root: str, machine: str) -> UnifiedMemory:
    """The verdict from the files under ``root`` (``/`` on the machine itself), on a CPU
    of architecture ``machine`` (``platform.machine()``)."""
    tegra = _read(root, "proc/device-tree/compatible")
    if tegra and "nvidia,tegra" in tegra:
        name = next(p for p in tegra.split("\0") if p.startswith("nvidia,tegra"))
        return UnifiedMemory(True, f"/proc/device-tree/compatible names {name}: an integrated GPU")
    models = _nvidia_models(root)
    if not models:
        return UnifiedMemory(False, "no NVIDIA GPU in /proc/driver/nvidia/gpus")
    found = _gpu_memory_nodes(root) if machine in ("aarch64", "arm64") else []
    if found:
        node, nbytes = found[0]
        return UnifiedMemory(True, f"NUMA node{node} has {format_size(nbytes)} of memory and no CPU beside an "
                                   f"{models[0][1]} on {machine}: the GPU's memory on line as host memory")
    for where, model in models:
        if any(name in model.split() for name in _INTEGRATED_MODELS):
            return UnifiedMemory(True, f"{where}: {model}, an integrated GPU")
    return UnifiedMemory(False, f"{models[0][1]} with memory of its own")


def _read(root: str, path: str) -> str | None:
    try:
        with open(os.path.join(root, path), encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return None


def _nvidia_models(root: str) -> list[tuple[str, str]]:
    """``(file, model)`` of each GPU the NVIDIA driver lists."""
    folder = os.path.join(root, "proc/driver/nvidia/gpus")
    try:
        buses = sorted(os.listdir(folder))
    except OSError:
        return []
    out = []
    for bus in buses:
        path = f"proc/driver/nvidia/gpus/{bus}/information"
        text = _read(root, path) or ""
        model = next((line.partition(":")[2].strip() for line in text.splitlines() if line.startswith("Model:")), "")
        out.append((f"/{path}", model or "NVIDIA GPU"))
    return out


def _node_list(text: str | None) -> set[int]:
    """The kernel's node list format (``0-1,4``) as a set."""
    nodes: set[int] = set()
    for part in (text or "").strip().split(","):
        first, _, last = part.partition("-")
        if first.isdigit() and (last.isdigit() or not last):
            nodes.update(range(int(first), int(last or first) + 1))
    return nodes


def _gpu_memory_nodes(root: str) -> list[tuple[int, int]]:
    """``(node, bytes)`` of NUMA nodes with memory and no CPU."""
    base = "sys/devices/system/node"
    memory, cpus = _node_list(_read(root, f"{base}/has_memory")), _node_list(_read(root, f"{base}/has_cpu"))
    out = []
    for node in sorted(memory - cpus):
        text = _read(root, f"{base}/node{node}/meminfo") or ""
        total = next((line.split() for line in text.splitlines() if "MemTotal:" in line), None)
        if total and total[-1] == "kB" and total[-2].isdigit() and int(total[-2]) > 0:
            out.append((node, int(total[-2]) * 1024))
    return out
