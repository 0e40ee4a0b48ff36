"""The device check: what only a machine with a GPU can say, in one command (under 8 minutes).

    python bench/device_check.py                 # on a CUDA host: writes bench/out/device_check.md and .json
    python bench/device_check.py --dry-run       # on any host: everything but the CUDA calls

Five parts, each timed and reported on its own (one that fails is reported and the
others still run):

1. calibrate: ``hostmem calibrate`` of a folder here and, on the GPU, host-to-device
   rates at layer size from pinned, pageable, mapped and mapped-then-registered memory;
2. register: ``cudaHostRegister`` in place on a read-only file mapping: does it succeed
   read-only, do the pages stay file-backed (pagemap) and does the accountant count them
   pinned, what ``VmLck``/``VmPin``/``Mlocked`` do; and what torch's caching host allocator
   locks for the same request (the dry run registers with mlock, the CPU twin);
3. executor: a synthetic DiT larger than the device budget (``device.vram`` half the
   model) planned with the measured rates, resident + pinned + streamed, under
   ``planners.execute`` on the GPU: per pass copy and wait time against the plan's
   prediction, outputs against the model run whole on the same device (the dry run:
   on the CPU, against the CPU);
4. orders: the executor on a smaller synthetic DiT in the orders servers run (blocks
   skipped as step caches do, reversed, repeated, a pass stopped halfway, CFG's two
   passes, weights replaced between and during passes): every pass against the same
   order and replacements on the model run whole on the same device, bit for bit (the
   dry run: the host path and the device path's CPU twin, against the CPU);
5. shared build: ``bench/bench_shared_build.py`` (4 ranks) on this machine's cores
   (``--quick`` in the dry run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from hostmem.units import format_size, parse_size  # noqa: E402

PARTS = ("calibrate", "register", "executor", "orders", "shared_build")


def _status() -> dict:
    """VmLck, VmPin and RssAnon of this process, Mlocked of the machine (bytes)."""
    from hostmem.procfs import parse_meminfo, read_status
    from hostmem.procfs.files import read_text

    status = read_status()
    mlocked = parse_meminfo(read_text("/proc/meminfo")).get("Mlocked", 0) * 1024
    return {"VmLck": status.vm_lck, "VmPin": status.vm_pin, "RssAnon": status.rss_anon, "Mlocked": mlocked}


def _delta(before: dict, after: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in before}


def part_calibrate(args, work: str) -> dict:
    from planners.commands.calibrate import measure

    ns = argparse.Namespace(config=None, path=[], root=work, size=args.calibrate_size, layer_size=args.layer_size,
                            device=None if args.dry_run else args.device, json=True)
    return measure(ns, use_device=not args.dry_run)


def _register_probe(args, path: str) -> dict:
    """Register (or, dry, mlock) a read-only mapping of ``path`` in place and look at it."""
    import torch

    import hostmem
    from hostmem.pinning import CudaHostRegisterBackend, MlockBackend, PinError, page_span
    from hostmem.residency import classify_range
    from hostmem.safetensors.mapping import open_readonly

    mapped = open_readonly(path)
    name = max(mapped.keys(), key=lambda k: mapped.header.tensors[k].nbytes)
    weight = mapped.get_tensor(name)
    weight.reshape(-1).view(torch.uint8)[::4096].sum()  # fault every page in: the classifier sees them resident
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(weight, requires_grad=False)
    start, end = page_span(weight)
    backend = MlockBackend() if args.dry_run else CudaHostRegisterBackend()
    before, classes_before = _status(), classify_range(start, end)
    out = {"backend": backend.name, "bytes": end - start, "read_only_mapping": True}
    try:
        backend.lock(start, end - start)
    except PinError as exc:
        return {**out, "succeeded": False, "error": str(exc)}
    try:
        after, classes = _status(), classify_range(start, end)
        ledger = hostmem.account({"m": module})
        counted = ledger.components["m"].parameters["w"].residency
        out.update(succeeded=True, status_delta=_delta(before, after),
                   file_backed_before=classes_before.file_backed, file_backed_after=classes.file_backed,
                   anonymous_after=classes.anonymous, pinned_after=classes.pinned, accountant_pinned=counted.pinned,
                   accountant_file_backed=counted.file_backed)
    finally:
        backend.unlock(start, end - start)
    return out


def _caching_allocator(args, nbytes: int) -> dict:
    """What torch's caching host allocator locks for ``nbytes`` (a CUDA host only)."""
    if args.dry_run:
        return {"skipped": "torch's pinned allocator needs CUDA"}
    import torch

    before = _status()
    block = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    block.fill_(1)
    after = _status()
    out = {"asked": nbytes, "status_delta": _delta(before, after), "is_pinned": bool(block.is_pinned())}
    del block
    return out


def part_register(args, work: str, checkpoint: str) -> dict:
    probe = _register_probe(args, checkpoint)
    return {"mapping": probe, "caching_allocator": _caching_allocator(args, probe["bytes"] + 4096 * 3 + 1)}


def _executor_config(checkpoint: str, model: int, transfer: dict, steps: int):
    from hostmem.procfs import read_status
    from planners.config import parse_config

    anon = read_status().rss_anon
    reserve = anon + (512 << 20)
    rates = "".join(f"  {k}: {v / 1e9:.3f}GB/s\n" for k, v in transfer.items())
    text = (
        "deployment: device-check\n"
        f"host: {{limit: {reserve + model * 2 // 5}B, reserve: {reserve}B, max_pinned: {model // 4}B}}\n"
        f"device: {{vram: {model // 2}B}}\n"
        f"workload: {{steps: {steps}}}\n"
        + (f"transfer:\n{rates}" if rates else "")
        + f"components:\n  dit: {{path: {json.dumps(checkpoint)}, layers: \"blocks.{{i}}.\", offload: layerwise}}\n"
    )
    return parse_config(text, os.path.join(os.path.dirname(checkpoint), "device-check.yaml"), environ={})


def part_executor(args, work: str, checkpoint: str, transfer: dict) -> dict:
    import torch

    from planners.executor import execute
    from planners.executor.synthetic import load_synthetic_dit
    from planners.startup import plan_loaded

    steps, model_bytes = 4, os.path.getsize(checkpoint)
    device = None if args.dry_run else args.device
    model = load_synthetic_dit(checkpoint)
    config = _executor_config(checkpoint, model_bytes, transfer, steps)
    plan = plan_loaded(config, {"dit": model})
    x = torch.randn(args.tokens, 64, generator=torch.Generator().manual_seed(0)).to(model.head.weight.dtype)
    x = x.to(device) if device else x
    with torch.no_grad(), execute(plan, {"dit": model}, device=device, prefetch=2,
                                  disk_read=config.transfer.disk_read) as run:
        outs = [model(x) for _ in range(steps)]
        stats = run.stats().to_dict()
    with torch.no_grad():
        whole = model.to(device) if device else model  # the reference: every weight on the device at once
        reference = whole(x)
    pins = plan.pins.plans["dit"]
    return {
        "model_bytes": model_bytes, "vram_budget": plan.device.vram, "steps": steps,
        "resident_layers": len(plan.device.resident_layers), "pinned_layers": len(pins.pinned_layers),
        "predicted_transfer_s_per_pass": pins.transfer_s_per_request / steps,
        "identical": all(torch.equal(o, reference) for o in outs),
        "max_abs_diff": max(float((o.float() - reference.float()).abs().max()) for o in outs), "executor": stats,
    }


def part_orders(args, work: str, transfer: dict) -> dict:
    from device_orders import run_orders  # bench/ is on sys.path: the script runs from there

    return run_orders(args, work, transfer, _executor_config)


def part_shared_build(args, work: str) -> dict:
    cmd = [sys.executable, os.path.join(HERE, "bench_shared_build.py"), "--workdir", os.path.join(work, "shared")]
    cmd += ["--quick"] if args.dry_run else []
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.shared_timeout)
    lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"bench_shared_build.py failed (rc {done.returncode}): {done.stderr[-1500:]}")
    found = json.loads(lines[-1])
    keep = ("ranks", "cores", "size_bytes", "first_start_ratio", "memory_ratio", "shared_build_seconds",
            "alone_seconds", "disk_bound_ratio", "cpu_bound_ratio")
    return {k: found.get(k) for k in keep}


def _run_parts(args, work: str) -> dict:
    from planners.executor.synthetic import write_synthetic_dit

    layers = 64
    d = int(math.sqrt(args.size / layers / 2))
    checkpoint = write_synthetic_dit(os.path.join(work, "dit.safetensors"), layers, d)
    results, transfer = {}, {}
    for part in PARTS:
        if part in args.skip:
            results[part] = {"skipped": "--skip"}
            continue
        began = time.perf_counter()
        try:
            if part == "calibrate":
                found = part_calibrate(args, work)
                transfer = found["transfer"]
            elif part == "register":
                found = part_register(args, work, checkpoint)
            elif part == "executor":
                found = part_executor(args, work, checkpoint, transfer)
            elif part == "orders":
                found = part_orders(args, work, transfer)
            else:
                found = part_shared_build(args, work)
        except Exception as exc:  # noqa: BLE001 - a part that fails is reported; the others still run
            found = {"error": f"{type(exc).__name__}: {exc}"}
        found["seconds"] = time.perf_counter() - began
        results[part] = found
        print(f"{part}: {time.perf_counter() - began:.1f} s", file=sys.stderr)
    return results


def _machine(args) -> str:
    with open("/proc/cpuinfo") as handle:
        cpu = next((l.split(":", 1)[1].strip() for l in handle if l.startswith("model name")), "unknown CPU")
    line = f"{cpu}, {os.cpu_count()} cores"
    if args.dry_run:
        return f"dry run (no CUDA call) on {line}"
    import torch

    return f"{torch.cuda.get_device_name(args.device)}, {line}, torch {torch.__version__}"


def _rate(value) -> str:
    return f"{format_size(value)}/s" if isinstance(value, (int, float)) else str(value)


def _lines(results: dict) -> list[str]:
    out = []
    for part, found in results.items():
        if "error" in found or "skipped" in found:
            out.append(f"- {part}: {found.get('error') or 'skipped (' + found['skipped'] + ')'}")
            continue
        if part == "calibrate":
            for f in found["folders"]:
                out.append(f"- calibrate: disk {_rate(f['disk_read'])}, page cache {_rate(f['page_cache_read'])}")
            h2d = found.get("h2d")
            if h2d:
                rates = ", ".join(f"{k} {_rate(v)}" for k, v in h2d.items() if k != "layer_bytes")
                out.append(f"- calibrate: host to device at {format_size(h2d['layer_bytes'])}: {rates}")
            out += [f"- calibrate: {n}" for n in found["notes"]]
        elif part == "register":
            m, c = found["mapping"], found["caching_allocator"]
            if not m.get("succeeded"):
                out.append(f"- register ({m['backend']}, read-only mapping): FAILED: {m.get('error')}")
            else:
                out.append(
                    f"- register ({m['backend']}) of {format_size(m['bytes'])} of a read-only mapping: succeeded; "
                    f"file-backed {format_size(m['file_backed_before'])} -> {format_size(m['file_backed_after'])}, "
                    f"pinned {format_size(m['pinned_after'])}, anonymous {format_size(m['anonymous_after'])}; "
                    "accountant: pinned "
                    f"{format_size(m['accountant_pinned'])}, file-backed {format_size(m['accountant_file_backed'])}; "
                    + ", ".join(f"{k} {format_size(v)}" for k, v in m["status_delta"].items()))
            if "asked" in c:
                out.append(f"- torch's caching host allocator, {c['asked']} bytes asked: "
                           + ", ".join(f"{k} {format_size(v)}" for k, v in c["status_delta"].items()))
        elif part == "executor":
            passes = found["executor"]["passes"]
            out.append(
                f"- executor: {format_size(found['model_bytes'])} model, device budget "
                f"{format_size(found['vram_budget'])}, {found['resident_layers']} resident, {found['pinned_layers']} "
                f"pinned, roles {found['executor']['roles']['dit']}; outputs identical to the model run whole: "
                f"{found['identical']} (largest difference {found['max_abs_diff']:.3g}); plan's transfer per pass {found['predicted_transfer_s_per_pass']:.3f} s")
            for p in passes:
                out.append(f"  - pass {p['index']}: {p['seconds']:.3f} s, copied {format_size(p['copied_bytes'])}, "
                           f"waited {p['wait_s']:.3f} s, read {format_size(p['read_bytes'])} from disk")
        elif part == "orders":
            for path, scenarios in found["paths"].items():
                same = [n for n, r in scenarios.items() if r["identical"]]
                differ = [f"{n} (largest difference {r['max_abs_diff']:.3g})" for n, r in scenarios.items()
                          if not r["identical"]]
                out.append(f"- orders on {path}: identical to the model run whole: {', '.join(same) or 'none'}"
                           + (f"; DIFFERENT: {', '.join(differ)}" if differ else ""))
        else:
            out.append("- shared build: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                                     for k, v in found.items()))
    return out


def write_report(args, results: dict) -> str:
    title = "## GPU device check" + (" (dry run)" if args.dry_run else "")
    command = "python bench/device_check.py" + (" --dry-run" if args.dry_run else "")
    body = [title, "", f"`{command}` on {_machine(args)}", "", *_lines(results), "",
            "<details><summary>JSON</summary>", "", "```json", json.dumps(results, default=str), "```", "",
            "</details>", ""]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        handle.write("\n".join(body))
    with open(os.path.splitext(args.out)[0] + ".json", "w") as handle:
        json.dump(results, handle, default=str)
    return args.out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="everything but the CUDA calls (any host)")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--size", type=parse_size, default=None, help="synthetic DiT (default 4GiB; dry run 64MiB)")
    parser.add_argument("--calibrate-size", type=parse_size, default=None, help="bytes read per folder")
    parser.add_argument("--layer-size", type=parse_size, default=None, help="bytes per timed device copy")
    parser.add_argument("--tokens", type=int, default=None, help="rows of the input (default 1024; dry run 8)")
    parser.add_argument("--skip", action="append", default=[], choices=PARTS, help="leave a part out")
    parser.add_argument("--shared-timeout", type=int, default=300)
    parser.add_argument("--out", default=os.path.join(HERE, "out", "device_check.md"))
    parser.add_argument("--workdir", default=None, help="where to write the checkpoints (default: a temp folder)")
    args = parser.parse_args(argv)
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("device_check: this host has no CUDA device; run with --dry-run", file=sys.stderr)
            return 2
    args.size = args.size or parse_size("64MiB" if args.dry_run else "4GiB")
    args.calibrate_size = args.calibrate_size or parse_size("64MiB" if args.dry_run else "1GiB")
    args.tokens = args.tokens or (8 if args.dry_run else 1024)
    with tempfile.TemporaryDirectory(prefix="hostmem-device-", dir=args.workdir or "/var/tmp") as work:
        results = _run_parts(args, work)
    print(f"wrote {write_report(args, results)}", file=sys.stderr)
    return 1 if any("error" in found for found in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
