"""The device check's orders part (see ``bench/device_check.py``): the executor in the orders a
server runs, every pass against the same order and replacements on the model run whole.

A scenario is a list of passes, each an order of blocks (indices) and an optional change made
before it: ``("new", k, s)`` gives block ``k`` a new weight (``s`` times its own, as a fuse or a
switch does), ``("in_place", k, d)`` adds ``d`` through ``.data`` (as peft's merge does; a mapped
weight is copied first), ``("during", k, j)`` gives block ``j`` a new weight while block ``k`` runs.
Every change is made on the host, and the model run whole gets the same tensor moved to the
device, so both compute from the same bits.
"""

from __future__ import annotations

import math
import os

LAYERS = 16


def scenarios() -> dict[str, list]:
    full = list(range(LAYERS))
    edge = [0, 1, LAYERS - 2, LAYERS - 1]
    return {
        "skip": [(full, None), (edge, None), (edge, None), (full, None)],
        "reverse": [(full[::-1], None)] * 3,
        "repeat": [([0, 1, 2, 2, 2, *full[3:]], None)] * 2,
        "partial": [(full[: LAYERS // 2], None), (full, None), (full[:3], None)],
        "cfg": [(full, None), (full, None)],
        "inference-mode": [(full, None), (full[::-1], None), (edge, None)],  # entered inside torch.inference_mode()
        "replace": [(full, None), (full, ("new", 0, 0.5)), (full, ("in_place", 0, 1e-3)),
                    (full[::-1], ("new", 5, 2.0)), (full, ("during", 3, 7))],
    }


def _change(model, change):
    """Apply ``change`` on the host; return ``(block, new host tensor)`` for the model run whole."""
    import torch

    kind, k, value = change
    proj = model.blocks[k].proj
    if kind == "new":
        proj.weight = torch.nn.Parameter(proj.weight.detach() * value, requires_grad=False)
    else:
        proj.weight = torch.nn.Parameter(proj.weight.detach().clone(), requires_grad=False)  # mapped: read-only
        proj.weight.data += value
    return k, proj.weight.detach()


def _pass(model, whole, order, change, x, device):
    """One pass of both models; ``(executor's output, the whole model's)``."""
    import torch

    def place(k, tensor):
        whole.blocks[k].proj.weight = torch.nn.Parameter(tensor.to(device) if device else tensor, requires_grad=False)

    if change is not None and change[0] == "during":  # the target runs after ``at``: the whole model has it all pass
        at, target = change[1], change[2]
        hook = model.blocks[at].register_forward_pre_hook(lambda m, a: place(*_change(model, ("new", target, 0.25))))
        out = model(x, order=order)
        hook.remove()
        return out, whole(x, order=order)
    if change is not None:
        place(*_change(model, change))
    return model(x, order=order), whole(x, order=order)


def _scenario(checkpoint, plan, passes, device, tokens, inference_mode: bool = False) -> dict:
    import torch

    from planners.executor import execute
    from planners.executor.synthetic import load_synthetic_dit

    model = load_synthetic_dit(checkpoint)
    whole = load_synthetic_dit(checkpoint)
    whole = whole.to(device) if device not in (None, "cpu") else whole
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(0)).to(model.head.weight.dtype)
    x = x.to(device) if device not in (None, "cpu") else x
    outs = []
    grad_off = torch.inference_mode() if inference_mode else torch.no_grad()  # the slots are made outside it
    with grad_off, execute(plan, {"dit": model}, device=device, prefetch=2) as run:
        for order, change in passes:
            run.settle()  # a change made next cannot race a copy in flight: it must be caught
            outs.append(_pass(model, whole, order, change, x, device if device != "cpu" else None))
        late = [p.late_layers for p in run.stats().passes]
    return {"identical": all(torch.equal(a, b) for a, b in outs),
            "max_abs_diff": max(float((a.float() - b.float()).abs().max()) for a, b in outs),
            "passes": len(outs), "late_layers": late}


def _exit_scenario(checkpoint, plan, device, tokens) -> dict:
    """A weight outside the layers written in place during the run (through ``.data``, as peft's
    ``fuse_lora`` writes) and a parameter added beside it there (as ``load_lora_weights`` adds its
    factors on the weight's device): after exit both are the host's, and the model computes as
    the same model changed the same way without the executor."""
    import torch

    from planners.executor import execute
    from planners.executor.synthetic import load_synthetic_dit

    def own(model):  # writable weights of their own, as after a private load
        for p in model.parameters():
            p.data = p.data.clone()
        return model

    model, whole = own(load_synthetic_dit(checkpoint)), own(load_synthetic_dit(checkpoint))
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(0)).to(model.head.weight.dtype)
    with torch.no_grad():
        whole.head.weight.data.mul_(2.0)
        expected = whole(x)
        with execute(plan, {"dit": model}, device=device, prefetch=2) as run:
            model(x.to(device) if device not in (None, "cpu") else x)
            run.settle()
            head = model.head.weight
            head.data.mul_(2.0)
            model.head.register_parameter("added", torch.nn.Parameter(torch.zeros(1, device=head.device,
                                                                                  dtype=head.dtype)))
        got = model(x)
    on_host = all(p.device.type == "cpu" for p in model.parameters())
    return {"identical": bool(torch.equal(got, expected)) and on_host,
            "max_abs_diff": float((got.float() - expected.float()).abs().max()), "passes": 2,  # in the run, after it
            "on_host_after_exit": on_host}


def run_orders(args, work: str, transfer: dict, make_config) -> dict:
    """Every scenario on this host's paths: the GPU, or (dry run) the host path and the device twin."""
    import torch

    from planners.executor.synthetic import load_synthetic_dit, write_synthetic_dit
    from planners.startup import plan_loaded

    if args.dry_run:
        torch.set_num_threads(1)  # small matmuls: a second thread only spins on a busy host
    size = max(args.size // 4, 4 << 20)
    d = int(math.sqrt(size / LAYERS / 2))
    checkpoint = write_synthetic_dit(os.path.join(work, "orders.safetensors"), LAYERS, d)
    config = make_config(checkpoint, os.path.getsize(checkpoint), transfer, 3)
    plan = plan_loaded(config, {"dit": load_synthetic_dit(checkpoint)}, quiet=True)
    paths = {"host": None, "device twin (cpu)": "cpu"} if args.dry_run else {args.device: args.device}
    tokens = args.tokens
    out = {"layers": LAYERS, "model_bytes": os.path.getsize(checkpoint), "paths": {}}
    for name, device in paths.items():
        out["paths"][name] = {n: _scenario(checkpoint, plan, p, device, tokens, n == "inference-mode")
                              for n, p in scenarios().items()}
        out["paths"][name]["written, then exit"] = _exit_scenario(checkpoint, plan, device, tokens)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out
