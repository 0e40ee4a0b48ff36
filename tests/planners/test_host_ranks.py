"""Several ranks on one host over a real gloo process group (torch.multiprocessing, 127.0.0.1).

Four ranks each map the same read-only safetensors file. Ranks 0 and 1 first gather
over a group of their own (2 ranks), then all four over the world (4 ranks): the host
ledger counts the file's pages once, the host budget is split so that the shares fit
it (and each rank's plan_loaded pins within its share), and a rank that never calls in
fails the others, named, within the timeout.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hostmem
from hostmem.residency_classes import Residency
from planners.config import load_config
from planners.host_share import RankNeed, share_for
from planners.report import report_dict
from planners.startup import plan_loaded

MiB = 1024 * 1024
FILE_BYTES = 8 * MiB
WORLD = 4
# 16 MiB above four reserves: each rank could pin its 8 MiB of streamed layers, the host
# gives 4 MiB to each.
LIMIT = 4 * 1024 * MiB + 16 * MiB
CONFIG = f"""
deployment: ranks
host: {{limit: {LIMIT}, reserve: 1GiB, max_pinned: 100%}}
workload: {{steps: 2}}
components:
  dit: {{path: dit.safetensors, layers: "blocks.{{i}}.", offload: layerwise}}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mapped_module(path) -> torch.nn.Module:
    """``blocks.{i}.weight`` of the file as read-only mapped buffers, every page faulted in."""
    tensors = hostmem.load_readonly(path)
    module = torch.nn.Module()
    module.blocks = torch.nn.ModuleList(torch.nn.Module() for _ in tensors)
    for i, block in enumerate(module.blocks):
        block.register_buffer("weight", tensors[f"blocks.{i}.weight"])
        float(block.weight.sum())
    return module


def _gather(module, config, rank: int, group=None) -> dict:
    """This rank's view of the host: the file's figures, and a share of a host budget."""
    host = hostmem.gather_host_ledger(hostmem.account({"dit": module}), group, components={"dit": module})
    out = {"ranks": list(host.ranks), "text": host.to_text(), "dit": host.components["dit"].to_dict()}
    if group is not None:  # needs that differ: 1 GiB, 2 GiB
        out["share"] = share_for(config, LIMIT, RankNeed((rank + 1) * 1024 * MiB, Residency()), group=group).to_dict()
    else:  # what a server does: plan_loaded splits the host budget by the ranks' measured needs
        plan = plan_loaded(config, {"dit": module})
        out["share"], out["budget"], out["pinned"] = report_dict(plan)["host_share"], plan.budget.bytes, \
            plan.pins.pinned_bytes
    return out


def _rank_main(rank: int, port: int, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=20))
    out = {}
    try:
        module = _mapped_module(os.path.join(folder, "dit.safetensors"))
        config = load_config(os.path.join(folder, "deploy.yaml"), environ={})
        pair = dist.new_group([0, 1])
        if rank < 2:
            out[2] = _gather(module, config, rank, pair)
        out[WORLD] = _gather(module, config, rank)
        if rank == WORLD - 1:  # never arrives at the next call
            _stay_away(folder, out)
        try:
            hostmem.gather_host_ledger(hostmem.account({"dit": module}), timeout=2)
        except hostmem.HostGatherError as exc:
            out["missing"], out["error"] = list(exc.missing), str(exc)
    finally:
        with open(os.path.join(folder, f"rank{rank}.json"), "w") as handle:
            json.dump(out, handle)


def _stay_away(folder: str, out: dict) -> None:
    """The missing rank: report, then stay out of the call until the others have given up
    on it, and leave without tearing down gloo (leaving while they still waited on it, its
    connection threads could abort the process at exit)."""
    with open(os.path.join(folder, f"rank{WORLD - 1}.json"), "w") as handle:
        json.dump(out, handle)
    others = [os.path.join(folder, f"rank{r}.json") for r in range(WORLD - 1)]
    deadline = time.monotonic() + 120
    while not all(os.path.exists(p) for p in others) and time.monotonic() < deadline:
        time.sleep(0.05)
    os._exit(0)


def _check(view: dict, rank: int, world: int, first_shares: list[int]) -> None:
    """The file once in the host's figures; one split of one host budget, seen alike."""
    assert view["ranks"] == list(range(world))
    dit = view["dit"]
    assert dit["precision"] in ("pfn", "pss")
    assert abs(dit["totals"]["file_backed"] - FILE_BYTES) <= 0.05 * FILE_BYTES, view["text"]
    assert abs(dit["summed"]["file_backed"] - world * FILE_BYTES) <= 0.05 * world * FILE_BYTES
    assert f"{world} ranks on " in view["text"] and "8.0 MiB in page cache once" in view["text"]
    share = view["share"]
    assert share["source"] == "process group" and share["local_rank"] == rank
    assert sum(share["shares_bytes"]) <= share["host_budget_bytes"]
    assert share["shares_bytes"] == first_shares  # one split, seen alike by every rank
    if world == 2:
        assert share["needs_bytes"] == [1024 * MiB, 2048 * MiB]
        assert share["host_budget_bytes"] == LIMIT - 2 * 1024 * MiB
        assert share["shares_bytes"] == [share["host_budget_bytes"] * n // (3072 * MiB) for n in share["needs_bytes"]]
    else:
        assert share["needs_bytes"] == [FILE_BYTES] * world
        assert 0 < share["host_budget_bytes"] <= 16 * MiB
        assert view["budget"] == share["share_bytes"] == share["host_budget_bytes"] // world
        assert 0 < view["pinned"] <= view["budget"]


def test_ranks_on_one_host_share_pages_once_split_one_budget_and_name_a_missing_rank(tmp_path):
    hostmem.save_file({f"blocks.{i}.weight": torch.ones(256, 1024) for i in range(FILE_BYTES // MiB)},
                      os.fspath(tmp_path / "dit.safetensors"))
    (tmp_path / "deploy.yaml").write_text(CONFIG.lstrip())
    mp.spawn(_rank_main, args=(_free_port(), os.fspath(tmp_path)), nprocs=WORLD)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for world in (2, WORLD):
        first = results[0][str(world)]["share"]["shares_bytes"]
        for rank in range(world):
            _check(results[rank][str(world)], rank, world, first)
    for rank in range(WORLD - 1):
        out = results[rank]
        assert out["missing"] == [WORLD - 1], out.get("error")
        assert out["error"].startswith(f"rank {WORLD - 1} did not arrive within 2 s")
