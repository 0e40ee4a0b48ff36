"""Shared pieces of the benchmarks: synthetic checkpoints, timing, result lines."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hostmem.safetensors.mapping import save_file  # noqa: E402
from hostmem.units import format_size, parse_size  # noqa: E402


def bench_args(description: str, default_size: str, quick_size: str,
               switches: dict[str, str] | None = None) -> argparse.Namespace:
    """The common flags: --size, --quick (small, for a smoke run) and --workdir, plus a
    benchmark's own on/off ``switches`` (flag: help)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--size", default=None, help=f"model size (default {default_size})")
    parser.add_argument("--quick", action="store_true", help=f"smoke run at {quick_size}")
    parser.add_argument("--workdir", default=None, help="where to write checkpoints (default: a temp folder)")
    for flag, text in (switches or {}).items():
        parser.add_argument(flag, action="store_true", help=text)
    args = parser.parse_args()
    args.size_bytes = parse_size(args.size or (quick_size if args.quick else default_size))
    return args


def workdir(args) -> tempfile.TemporaryDirectory | None:
    """A temporary folder on a real disk (never tmpfs) unless --workdir names one."""
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
        set_workdir_for_machine(args.workdir)
        return None
    tmp = tempfile.TemporaryDirectory(prefix="hostmem-bench-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    args.workdir = tmp.name
    set_workdir_for_machine(tmp.name)
    return tmp


def write_layered_checkpoint(folder: str, total_bytes: int, tensors: int, shards: int = 4,
                             dtype=torch.bfloat16, prefix: str = "blocks") -> list[str]:
    """Write ``tensors`` equal bf16 tensors adding up to ``total_bytes``, in ``shards`` files."""
    per_tensor = max(1024, total_bytes // tensors)
    cols = 1024
    rows = max(1, per_tensor // (cols * torch.finfo(dtype).bits // 8))
    paths, per_shard = [], -(-tensors // shards)
    generator = torch.Generator().manual_seed(0)
    for shard in range(shards):
        names = range(shard * per_shard, min(tensors, (shard + 1) * per_shard))
        chunk = {f"{prefix}.{i}.weight": torch.randn(rows, cols, generator=generator).to(dtype) for i in names}
        if not chunk:
            break
        path = os.path.join(folder, f"model-{shard:05d}-of-{shards:05d}.safetensors")
        save_file(chunk, path, writeback=True, fsync=True)  # on disk before any clock: no writeback later
        paths.append(path)
    return paths


def write_lora_model(folder: str, layers: int, rows: int, cols: int, rank: int, adapter_name: str,
                     shards: int = 4, ulps: float = 3) -> tuple[list[str], str]:
    """A bf16 checkpoint of ``layers`` layers of ``rows`` x ``cols`` (``blocks.{i}.proj.weight``,
    in ``shards`` files), and a rank-``rank`` kohya-style adapter on every layer whose update is
    about ``ulps`` bf16 steps of a weight of magnitude one: none rounds away, so a merge is
    measured doing its work. ``(shard paths, adapter path)``.

    Each entry of up @ down sums ``rank`` products, so its spread is up's * down's * rank**0.5:
    down is drawn at 1/cols**0.5, up at the rest.
    """
    os.makedirs(folder, exist_ok=True)
    up_spread = ulps * 2.0**-7 / rank**0.5 * cols**0.5
    gen = torch.Generator().manual_seed(0)
    per_shard, paths = -(-layers // shards), []
    for shard in range(shards):
        names = range(shard * per_shard, min(layers, (shard + 1) * per_shard))
        tensors = {f"blocks.{i}.proj.weight": torch.randn(rows, cols, generator=gen).to(torch.bfloat16) for i in names}
        paths.append(os.path.join(folder, f"dit-{shard + 1:05d}-of-{shards:05d}.safetensors"))
        save_file(tensors, paths[-1], writeback=True, fsync=True)  # on disk before any clock: no writeback later
        del tensors
    adapter = {}
    for i in range(layers):
        stem = f"diffusion_model.blocks.{i}.proj"
        adapter[f"{stem}.lora_down.weight"] = (torch.randn(rank, cols, generator=gen) / cols**0.5).to(torch.bfloat16)
        adapter[f"{stem}.lora_up.weight"] = (torch.randn(rows, rank, generator=gen) * up_spread).to(torch.bfloat16)
        adapter[f"{stem}.alpha"] = torch.tensor(float(rank))
    adapter_path = os.path.join(folder, adapter_name)
    save_file(adapter, adapter_path, fsync=True)
    return paths, adapter_path


def stream_pass(tensors: list[torch.Tensor]) -> int:
    """One pass over every weight into one staging buffer, as streaming them to a GPU reads
    them; the bytes passed."""
    staging = torch.empty(max(t.numel() for t in tensors), dtype=tensors[0].dtype)
    for tensor in tensors:
        staging[: tensor.numel()].view(tensor.shape).copy_(tensor)
    return sum(t.numel() * t.element_size() for t in tensors)


def drop_from_page_cache(paths: list[str]) -> None:
    """Evict the files' pages, so that the next reader brings them in from the disk."""
    for path in paths:
        with open(path, "rb", buffering=0) as handle:
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def read_around_page_cache(paths: list[str]) -> None:
    """Read every byte of the files with ``O_DIRECT``: nothing enters this machine's page
    cache, while a virtual machine's host, which caches its guest's disk, now holds them
    all. A host's cache favours the files read last: after this, every file a trial reads
    comes from the same place, whichever trial ran before (see bench_first_pass)."""
    import mmap

    buffer = mmap.mmap(-1, 8 << 20)  # page-aligned, as O_DIRECT asks
    try:
        for path in paths:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
            try:
                while os.readv(fd, [buffer]) > 0:
                    pass
            finally:
                os.close(fd)
    finally:
        buffer.close()


SETTLE_S = 5.0  # idle seconds after which a guest's freed memory has gone back to its host (reported after ~2 s)


def fresh_memory_cost(nbytes: int = 1 << 30, settle_s: float = SETTLE_S) -> dict:
    """Seconds per GiB to touch new anonymous memory, right after the same amount was freed
    and again after ``settle_s`` idle seconds: ``{"recycled": s, "settled": s}``.

    A virtual machine whose balloon reports free pages gives them back to its host about
    two seconds after they are freed; touching one afterwards is a fault in the host too.
    The area asks for huge pages, as numpy's and the page cache's large allocations do: on a
    2-core Firecracker guest the second figure was 35-60x the first for them (0.09-0.16
    against 3.5-5.7 s per GiB), where 4 KiB pages cost 0.7-1.1 s either way. A start that
    allocates its weights (an in-place merge) or writes through the page cache pays that on
    a machine that was idle, and barely at all right after another process freed as much."""
    import mmap
    import time

    def touch() -> float:
        area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # not shmem
        area.madvise(mmap.MADV_HUGEPAGE)  # as large allocations and the page cache's large folios are
        started = time.perf_counter()
        for offset in range(0, nbytes, 4096):
            area[offset] = 1
        seconds = time.perf_counter() - started
        area.close()
        return seconds * (1 << 30) / nbytes

    touch()
    recycled = touch()
    time.sleep(settle_s)
    return {"recycled": recycled, "settled": touch()}


def child_scenario(script: str, name: str, spec: dict) -> dict:
    """Run ``script --scenario name SPEC`` in a fresh interpreter; the JSON of its last line.

    Starts are measured as an installed package has them, with its modules' bytecode cached
    (an install compiles it): a shell that forbids writing it would charge every start with
    compiling the project from source."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    done = subprocess.run([sys.executable, script, "--scenario", name, json.dumps(spec)],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"scenario {name} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def disk_of(folder: str) -> dict:
    """The block device and filesystem under ``folder``: what a write or read figure is of."""
    device = os.stat(folder).st_dev
    found = {"device": f"{os.major(device)}:{os.minor(device)}", "filesystem": None, "model": None,
             "rotational": None}
    sys_dir = f"/sys/dev/block/{os.major(device)}:{os.minor(device)}"
    if os.path.exists(sys_dir):
        name = os.path.basename(os.path.realpath(sys_dir))
        disk = os.path.realpath(os.path.join(sys_dir, "..")) if os.path.exists(os.path.join(sys_dir, "partition")) \
            else os.path.realpath(sys_dir)
        found["device"] = name
        for key, leaf in (("model", "device/model"), ("rotational", "queue/rotational")):
            try:
                with open(os.path.join(disk, leaf)) as handle:
                    found[key] = handle.read().strip()
            except OSError:
                pass
    best = ""
    with open("/proc/mounts") as handle:
        for line in handle:
            _, mount, fstype, *_ = line.split()
            real = os.path.realpath(folder)
            inside = mount == "/" or real == mount or real.startswith(mount + "/")
            if inside and len(mount) > len(best):
                best, found["filesystem"] = mount, fstype
    return found


def machine_summary(folder: str | None = None) -> dict:
    """What every figure was measured on: CPU model and the flags that decide the merge's
    kernels (avx512_bf16, amx), cores, torch's version, and the disk under ``folder``."""
    from lora_cache.kernels import machine
    from lora_cache.kernels.precision import instruction_caps

    found = dict(machine())
    caps = instruction_caps()
    if caps:  # torch's kernels held to fewer instructions than the CPU has
        found["instruction_caps"] = caps
    if folder is not None:
        found["disk"] = disk_of(folder)
    return found


def machine_line(found: dict) -> str:
    """``machine_summary`` in one line for people."""
    flags = set(found["flags"])
    marks = ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in ("avx512_bf16", "amx_bf16"))
    line = f"{found['cpu']} ({marks}), {found['cpus']} cores, torch {found['torch']}"
    if found.get("instruction_caps"):
        line += " held to " + ", ".join(f"{k}={v}" for k, v in found["instruction_caps"].items())
    if "disk" in found:
        disk = found["disk"]
        line += f", disk {disk['device']} ({disk['model'] or 'model unknown'}, {disk['filesystem']})"
    return line


_MACHINE: dict = {}


def set_workdir_for_machine(folder: str) -> None:
    """Name the folder whose disk the figures of this benchmark are of."""
    _MACHINE.clear()
    _MACHINE.update(machine_summary(folder))


def report(name: str, lines: list[str], summary: dict) -> None:
    """Print readable lines, then one JSON line (sizes in bytes) for machines, both with the
    machine the figures come from (CPU model and flags, cores, torch, disk)."""
    found = _MACHINE or machine_summary()
    print(f"== {name}")
    print(f"  measured on: {machine_line(found)}")
    for line in lines:
        print(f"  {line}")
    print(json.dumps({"bench": name, "machine": found, **summary}))


__all__ = ["SETTLE_S", "bench_args", "fresh_memory_cost", "workdir", "write_layered_checkpoint", "timed", "report",
           "format_size", "machine_summary", "machine_line"]
