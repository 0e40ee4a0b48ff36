"""The shared build: ranks of one host (gloo on the CPU, spawned processes) build a missing
combination together, each a disjoint share, and every rank ends with the same merged
weights as a single-process merge. One spawn per world size runs several scenarios.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import socket
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

import lora_cache
from lora_cache.kernels.workers import block_workers, cpu_count, worker_count
from lora_cache.placement.layers import LayerTarget, checkpoint_module
from lora_cache.ranks.shared_build import _split_files, share_of_cores, rank_threads, split_by_bytes
from tests.conftest import write_safetensors
from tests.fresh_fork import rank_context, with_parent_stdio
from tests.lora_cache.test_adapters import lora_change, mapped_model, write_adapter

SHAPES = [(96, 64), (64, 64), (128, 32), (32, 96), (64, 128), (80, 64), (48, 48), (64, 16), (16, 64)]
LATE_TIMEOUT = 3.0
RANK_TIMEOUT = 60.0  # a rank that crashed fails the others in a minute, not the default 600 s


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A base checkpoint of 9 fp32 layers of different sizes, an adapter on each, and the
    single-process merge of the two (the reference every rank must match bit for bit)."""
    folder = tmp_path_factory.mktemp("shared-build")
    gen = torch.Generator().manual_seed(0)
    layers = {f"blocks.{i}.proj.weight": torch.randn(*s, generator=gen) for i, s in enumerate(SHAPES)}
    base = write_safetensors(folder / "base.safetensors", layers)
    changes = {f"blocks.{i}.proj": lora_change(*s, 4, i, alpha=2) for i, s in enumerate(SHAPES)}
    adapter = write_adapter(folder / "turbo.safetensors", "comfyui", changes)
    model = checkpoint_module([base])
    stats = lora_cache.merge(model, [adapter], cache_root=str(folder / "single"), progress=False)
    assert stats.built == len(SHAPES)
    reference = write_safetensors(folder / "reference.safetensors",
                                  {n: p.detach().clone() for n, p in model.named_parameters()})
    return {"base": base, "adapter": adapter, "reference": reference}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _merge(paths: dict, root: str, **options) -> tuple:
    """Merge on this rank; the stats and whether every weight equals the reference."""
    from safetensors.torch import load_file

    model = checkpoint_module([paths["base"]])
    stats = lora_cache.merge(model, [paths["adapter"]], cache_root=root, progress=False, **options)
    reference = load_file(paths["reference"])
    equal = all(torch.equal(p, reference[n]) for n, p in model.named_parameters())
    return model, {"built": stats.built, "hit": stats.hit, "equal": equal, "layers": stats.layers}


def _late(paths: dict, root: str, rank: int) -> dict:
    """Rank 1 never calls merge; rank 0 must fail within the timeout, naming it."""
    if rank != 0:
        return {}
    started = time.monotonic()
    try:
        _merge(paths, root, rank_timeout=LATE_TIMEOUT)
    except Exception as exc:  # noqa: BLE001 - what it raised is what the test checks
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - started}
    return {"error": None, "seconds": time.monotonic() - started}


def _rank_main(rank: int, world: int, port: int, paths: dict, folder: str, scenarios: list[str]) -> None:
    """One rank: join the gloo group, run the scenarios in order, write what each saw."""
    import torch.distributed as dist

    results: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        model = None
        for scenario in scenarios:
            if scenario == "build":
                model, results["build"] = _merge(paths, os.path.join(folder, "cache"), rank_timeout=RANK_TIMEOUT)
            elif scenario == "hit":
                lora_cache.unmerge(model)
                model, results["hit"] = _merge(paths, os.path.join(folder, "cache"), rank_timeout=RANK_TIMEOUT)
            elif scenario == "late":
                results["late"] = _late(paths, os.path.join(folder, "late-cache"), rank)
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        results["crash"] = traceback.format_exc()
    report_rank(folder, rank, results, leave="late" not in scenarios)
    if "late" in scenarios and rank != 0:
        _stay_away(folder)


def report_rank(folder: str, rank: int, results: dict, leave: bool = True) -> None:
    """Write what this rank saw to ``folder/rank<N>.json`` (what :func:`spawn_ranks` reads);
    ``leave``: then leave the process group, where there is one."""
    import torch.distributed as dist

    with open(os.path.join(folder, f"rank{rank}.json"), "w") as handle:
        json.dump(results, handle)
    if leave and dist.is_initialized():
        dist.destroy_process_group()


def _stay_away(folder: str) -> None:
    """The rank that never arrives: stay out until rank 0 has given up on it, and leave
    without tearing gloo down (leaving while rank 0 still waited on it, its connection
    threads could abort the process at exit)."""
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(folder, "rank0.json")) and time.monotonic() < deadline:
        time.sleep(0.05)
    os._exit(0)


def _spawn(inputs, folder, world: int, scenarios: list[str]) -> list[dict]:
    return spawn_ranks(_rank_main, world, inputs, folder, scenarios)


def spawn_ranks(main, world: int, inputs, folder, *extra) -> list[dict]:
    """Run ``main(rank, world, port, inputs, folder, *extra)`` on ``world`` gloo ranks and
    return what each wrote to ``folder/rank<N>.json``, failing on a rank that crashed."""
    rank_context()  # the ranks fork from a server that imported torch once
    mp.start_processes(with_parent_stdio(main), args=(world, _free_port(), inputs, str(folder), *extra), nprocs=world, join=True,
                       start_method="forkserver")
    results = []
    for rank in range(world):
        with open(folder / f"rank{rank}.json") as handle:
            found = json.load(handle)
        assert "crash" not in found, f"rank {rank}: {found['crash']}"
        results.append(found)
    return results


def test_two_ranks_build_once_between_them_hit_after_and_fail_on_a_missing_rank(inputs, tmp_path):
    results = _spawn(inputs, tmp_path, 2, ["build", "hit", "late"])
    built = [r["build"]["built"] for r in results]
    assert sum(built) == len(SHAPES) and all(b > 0 for b in built), built  # one build, in parallel
    assert all(r["build"]["equal"] and r["build"]["layers"] == len(SHAPES) for r in results), results
    assert all(r["hit"]["built"] == 0 and r["hit"]["hit"] == len(SHAPES) and r["hit"]["equal"] for r in results)
    late = results[0]["late"]
    assert late["error"] and "rank 1 did not arrive" in late["error"], late
    assert LATE_TIMEOUT <= late["seconds"] < LATE_TIMEOUT + 20, late


def test_four_ranks_split_the_layers_into_disjoint_shares_that_add_up_to_one_build(inputs, tmp_path, capfd):
    """The layers built across four ranks add up to one build, each rank summing on its share
    of the host's cores (their stderr says how many); then they map the sealed combination
    together, under its lock held shared: none waits for another to adopt it."""
    results = _spawn(inputs, tmp_path, 4, ["build"])
    built = [r["build"]["built"] for r in results]
    assert sum(built) == len(SHAPES) and all(b > 0 for b in built), built
    assert all(r["build"]["equal"] for r in results), results
    threads = rank_threads(4)
    err = capfd.readouterr().err  # four processes' lines: one may run into another's
    said = re.findall(r"building share .*?, (\d+) summing thread", err)
    assert said == [str(threads)] * 4, err
    assert "adopting it" not in err and "waiting for it" not in err, err


def test_the_ranks_of_a_host_split_its_cores_at_least_one_thread_each():
    assert [rank_threads(n, cores=2) for n in (1, 2, 4, 8)] == [2, 1, 1, 1]
    assert [rank_threads(n, cores=64) for n in (1, 3, 4, 8)] == [64, 21, 16, 8]
    assert rank_threads(4) == max(1, cpu_count() // 4)


def test_a_share_of_the_cores_bounds_the_block_workers_and_torch_and_is_given_back():
    cpu, before = torch.device("cpu"), torch.get_num_threads()
    with block_workers(cpu) as workers:
        full = workers.threads
    assert full == worker_count()
    if full < 2 or before < 2:
        pytest.skip("one core: a share of it is all of it")
    with pytest.raises(RuntimeError, match="a share failed"):
        with share_of_cores(1):
            assert torch.get_num_threads() == 1  # the adapter's finiteness check runs on one thread too
            with block_workers(cpu) as workers:
                assert workers.threads == 1
            raise RuntimeError("a share failed")
    assert torch.get_num_threads() == before
    with block_workers(cpu) as workers:
        assert workers.threads == full


def test_shares_are_disjoint_cover_every_layer_and_balance_bytes():
    targets = []
    for i, (rows, cols) in enumerate(SHAPES):
        holder = torch.nn.Linear(cols, rows, bias=False)
        targets.append(LayerTarget(f"blocks.{i}.proj.weight", holder, "weight"))
    shares = split_by_bytes(targets, 4)
    names = [t.name for share in shares for t in share]
    assert sorted(names) == sorted(t.name for t in targets) and len(set(names)) == len(names)
    loads = [sum(t.nbytes for t in share) for share in shares]
    assert max(loads) - min(loads) <= max(t.nbytes for t in targets), loads


def test_the_key_inputs_are_hashed_in_disjoint_sets_balanced_by_bytes(tmp_path):
    sizes = [700, 300, 300, 200, 100, 100]
    paths = []
    for i, size in enumerate(sizes):
        (tmp_path / f"f{i}").write_bytes(b"x" * size)
        paths.append(str(tmp_path / f"f{i}"))
    sets = _split_files(paths, 3)
    assert sorted(p for s in sets for p in s) == sorted(paths)  # each file hashed by one rank
    assert [sum(os.path.getsize(p) for p in s) for s in sets] == [700, 500, 500]
    assert _split_files(list(reversed(paths)), 3) == sets  # the same split whatever order a rank lists them in


@pytest.mark.parametrize("value", ["soon", 0, -5, math.inf, math.nan, True, None])
def test_a_bad_rank_timeout_says_what_to_pass_and_merges_nothing(tmp_path, value):
    model = mapped_model(tmp_path)
    adapter = write_adapter(tmp_path / "a.safetensors", "kohya", {"blocks.0.attn.to_q": lora_change(64, 64, 4, 0)})
    with pytest.raises(ValueError, match=r"rank_timeout=.*: expected a number of seconds above 0 \(for example 600\)"):
        lora_cache.merge(model, [adapter], cache_root=tmp_path / "cache", rank_timeout=value)
    assert not lora_cache.is_merged(model) and not (tmp_path / "cache").exists()
