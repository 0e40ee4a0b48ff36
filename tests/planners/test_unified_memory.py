"""Unified-memory hosts: detected from the files such a machine shows, planned once.

Each machine is laid out under tmp_path as its kernel and NVIDIA driver show it (the
driver's /proc/driver/nvidia/gpus/BUS/information, the NUMA node lists and per-node
meminfo in /sys, a Jetson's device tree) and read through the code that reads "/".
"""

from __future__ import annotations

import json
import os
import platform

from planners.budget import resolve_host_limit
from planners.config import load_config
from planners.deployment import plan_deployment
from planners.device_plan import device_in_host_memory
from planners.report import report_dict, report_text
from planners.unified_memory import UnifiedMemory, read_unified_memory, unified_memory_at
from planners.whatif import what_if_components

GiB = 1024**3
MiB = 1024**2


def _lay_out(root, files: dict[str, str]) -> str:
    for path, text in files.items():
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as handle:
            handle.write(text)
    return str(root)


def _gpu(bus: str, model: str, bus_type: str = "PCIe") -> dict[str, str]:
    return {f"proc/driver/nvidia/gpus/{bus}/information": (
        f"Model: \t\t {model}\nIRQ:             0\nGPU UUID:        GPU-00000000-0000-0000-0000-000000000000\n"
        f"Video BIOS:      96.00.00.00.00\nBus Type:        {bus_type}\nDMA Size:        52 bits\n"
        f"DMA Mask:        0xfffffffffffff\nBus Location:    {bus}\nDevice Minor:    0\nGPU Excluded:    No\n")}


def _nodes(cpus: str, memory: str, sizes_kb: dict[int, int]) -> dict[str, str]:
    files = {"sys/devices/system/node/has_cpu": cpus + "\n", "sys/devices/system/node/has_memory": memory + "\n"}
    for node, kb in sizes_kb.items():
        files[f"sys/devices/system/node/node{node}/meminfo"] = (
            f"Node {node} MemTotal:       {kb} kB\nNode {node} MemFree:        {kb // 2} kB\n"
            f"Node {node} MemUsed:        {kb // 2} kB\n")
    return files


def test_grace_hopper_gpu_memory_on_line_as_a_cpu_less_numa_node_is_unified(tmp_path):
    gh200 = {**_gpu("0009:01:00.0", "NVIDIA GH200 480GB"),
             **_nodes("0", "0-1", {0: 480 * 1024 * 1024, 1: 96 * 1024 * 1024})}
    root = _lay_out(tmp_path, gh200)
    found = unified_memory_at(root, "aarch64")
    assert found.unified and "node1" in found.source and "96.0 GiB" in found.source and "GH200" in found.source
    # the same node lists on x86 are CXL or persistent memory, not a GPU's
    assert not unified_memory_at(root, "x86_64").unified


def test_an_integrated_gpu_and_a_jetson_are_unified_a_discrete_one_is_not(tmp_path):
    spark = _lay_out(tmp_path / "spark", {**_gpu("000f:01:00.0", "NVIDIA GB10"), **_nodes("0", "0", {0: 128 << 20})})
    found = unified_memory_at(spark, "aarch64")
    assert found.unified and "GB10" in found.source and "integrated" in found.source
    jetson = _lay_out(tmp_path / "jetson", {
        "proc/device-tree/compatible": "nvidia,p3768-0000+p3767-0005\0nvidia,p3767-0005\0nvidia,tegra234\0"})
    found = unified_memory_at(jetson, "aarch64")
    assert found.unified and "nvidia,tegra234" in found.source
    h100 = _lay_out(tmp_path / "h100", {**_gpu("0000:62:00.0", "NVIDIA H100 80GB HBM3"),
                                        **_nodes("0-1", "0-1", {0: 256 << 20, 1: 256 << 20})})
    found = unified_memory_at(h100, "x86_64")
    assert not found.unified and "H100" in found.source
    assert unified_memory_at(str(tmp_path / "nothing"), "x86_64") == UnifiedMemory(
        False, "no NVIDIA GPU in /proc/driver/nvidia/gpus")


def test_this_machine_is_read_through_the_same_code():
    assert read_unified_memory() == unified_memory_at("/", platform.machine())


def _plan(tmp_path, unified: bool, limit: str = "16GiB", device: str = "{vram: 8GiB, reserve: 1GiB}", more: str = ""):
    config_path = tmp_path / "deploy.yaml"
    config_path.write_text(
        f"deployment: spark\nhost: {{limit: {limit}, reserve: 2GiB}}\ndevice: {device}\n"
        "workload: {steps: 4}\ncomponents:\n"
        "  dit: {size: 12GiB, layers: 24, dtype: bf16, offload: layerwise, prefetch: 1}\n" + more)
    config = load_config(str(config_path))
    components, notes = what_if_components(config, "none")
    host = resolve_host_limit(config.host.limit, 128 * GiB, None)._replace(
        unified=UnifiedMemory(unified, "laid out for the test"))
    return plan_deployment(config, components, host, notes=tuple(notes))


def test_on_unified_memory_the_device_plan_is_host_memory_counted_once(tmp_path):
    discrete, unified = _plan(tmp_path, False), _plan(tmp_path, True)
    assert discrete.device == unified.device  # the same layers on the device either way
    on_device = device_in_host_memory(unified.device)
    # 1 GiB device reserve + 6 GiB left: a 1 GiB window (prefetch 1 of 0.5 GiB blocks) and 10 blocks kept
    assert on_device == 1 * GiB + 7 * GiB
    assert (discrete.budget.committed_device, unified.budget.committed_device) == (0, on_device)
    assert discrete.budget.room - unified.budget.room == on_device
    assert unified.pins.pinned_bytes <= unified.budget.room  # the pins are paid once, from what is left
    text = report_text(unified)
    assert "unified memory: yes (laid out for the test)" in text
    assert "- device plan (unified memory)" in text and "unified memory" not in report_text(discrete)
    data = json.loads(json.dumps(report_dict(unified)))
    assert data["host"]["unified_memory"] == {"unified": True, "source": "laid out for the test"}
    assert data["budget"]["committed"]["device_bytes"] == on_device
    assert data["budget"]["committed_bytes"] == on_device  # no weight is anonymous: the device plan alone


def test_a_plan_that_fits_a_discrete_host_is_refused_where_the_device_shares_its_memory(tmp_path):
    assert _plan(tmp_path, False, limit="9GiB").fits
    refused = _plan(tmp_path, True, limit="9GiB")
    assert not refused.fits
    assert refused.verdict.line.startswith("fits: no: committed 8.0 GiB + reserve 2.0 GiB > limit 9.0 GiB")


def test_the_plan_command_reports_this_machine(capsys):
    from planners.cli import main

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert main(["plan", os.path.join(repo, "configs", "workstation-24g.yaml"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["host"]["unified_memory"] == read_unified_memory()._asdict()


def test_without_a_device_budget_a_unified_host_counts_all_the_device_plan_asks(tmp_path):
    """``device.vram: 0`` ("no separate VRAM", as a GB10 has none): the device reserve, the
    text encoder copied onto the device while it runs and the streamed window are host
    memory all the same, counted against the host limit (they counted nothing: "fits"
    while the plan's own device peak was more than the limit left)."""
    text_encoder = "  text_encoder: {size: 6GiB, layers: 24, dtype: bf16, offload: full}\n"
    plan = _plan(tmp_path, True, limit="24GiB", device="{vram: 0, reserve: 4GiB}", more=text_encoder)
    assert plan.device.peak_bytes >= 4 * GiB + 6 * GiB  # the reserve and the text encoder while it runs
    assert plan.budget.committed_device == plan.device.peak_bytes
    assert plan.pins.pinned_bytes <= plan.budget.room
    refused = _plan(tmp_path, True, limit="11GiB", device="{vram: 0, reserve: 4GiB}", more=text_encoder)
    assert not refused.fits and refused.verdict.line.startswith("fits: no")
    assert _plan(tmp_path, False, limit="11GiB", device="{vram: 0, reserve: 4GiB}", more=text_encoder).fits


def test_without_a_device_budget_the_streamed_window_is_host_memory_too(tmp_path):
    """A DiT streamed onto a GB10 (``vram: 0``): each block is copied onto the device, so
    its prefetch window is host memory beside the device reserve; the plan left it out
    and said "fits" where the window pushed the host over its limit."""
    plan = _plan(tmp_path, True, limit="24GiB", device="{vram: 0, reserve: 4GiB}")
    window = 2 * (12 * GiB // 24)  # prefetch 1 (+ the block in use) of 0.5 GiB blocks
    assert plan.device.peak_bytes == 4 * GiB + window
    assert plan.budget.committed_device == plan.device.peak_bytes
    assert not _plan(tmp_path, True, limit="6.5GiB", device="{vram: 0, reserve: 4GiB}").fits
    assert _plan(tmp_path, False, limit="6.5GiB", device="{vram: 0, reserve: 4GiB}").fits
