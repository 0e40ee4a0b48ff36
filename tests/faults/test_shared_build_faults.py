"""A shared build of two ranks (real processes, gloo) meets a full disk or a dead rank.

The disk is a real, small ext4 image, loop-mounted, filled for real with
``posix_fallocate`` (the kernel's own ENOSPC); a rank is killed for real with SIGKILL.
After each: every weight a surviving rank serves is ``torch.equal`` to the in-place
merge, every rank says what happened in one line, and the next start builds.
Skipped where this machine cannot loop-mount.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
import traceback

import pytest

import lora_cache
from hostmem.vault import Vault
from hostmem.vault.content_hash import CONTENT_HASH_MEMO
from lora_cache.placement.layers import checkpoint_module
from tests.faults.test_folded_hash import markers
from tests.faults.test_full_disk_rekey import fill, small_disk
from tests.faults.world import COLS, LAYERS, ROWS, assert_same, leftovers, make_world, reference, start, weights
from tests.lora_cache.test_adapters import lora_change, write_adapter
from tests.lora_cache.test_shared_build import report_rank, spawn_ranks

FULL_DISK_WARNING = "merges in place instead"
FULL_DISK_AT = {  # where the disk fills: what every rank's one warning names
    "full from the start": "cannot create the LoRA merge cache folder",
    "full at a share's first layer": "could not write layer",
    "full at the seal": "manifest.json ([Errno 28] No space left on device)",
    "full at the re-key": "could not store the build under its key",
}
RANK_TIMEOUT = 10.0  # a rank that waits for a dead one gives up in seconds


def _fill_before(disk: str, owner, name: str) -> None:
    """This rank fills the disk just before its first call of ``owner.name``."""
    real, filled = getattr(owner, name), []

    def on_a_full_disk(*args, **kwargs):
        if not filled:
            filled.append(fill(disk))
        return real(*args, **kwargs)

    setattr(owner, name, on_a_full_disk)


KILL_STEPS = {  # where a rank is SIGKILLed: the gather it would arrive at next, or its share's first write
    "before the exchange": "start a shared LoRA merge build",
    "in its share": None,
    "at the seal": "seal the shared build",
}


def _die_at(step: str, session_module) -> None:
    """This rank SIGKILLs itself at ``step`` (one of :data:`KILL_STEPS`)."""
    from hostmem import host_ledger

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    if KILL_STEPS[step] is None:
        session_module.VaultSession._put_data = die
        return
    real = host_ledger.gather_on_host

    def gather(payload, **kwargs):
        if kwargs.get("what", "").startswith(KILL_STEPS[step]):
            die()
        return real(payload, **kwargs)

    host_ledger.gather_on_host = gather


def _rank_main(rank: int, world: int, port: int, paths: dict, folder: str, fault: str) -> None:
    """One rank: its stderr to ``rank<N>.err``, join the group, meet the fault, merge."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    err = os.open(os.path.join(folder, f"rank{rank}.err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(err, 2)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    results: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        from hostmem.vault import rekey as rekey_module, session as session_module

        if fault == "full at a share's first layer" and rank == 0:
            _fill_before(paths["disk"], session_module.VaultSession, "_put_data")
        if fault == "full at the seal" and rank == 0:
            _fill_before(paths["disk"], session_module, "write_manifest")
        if fault == "full at the re-key" and rank == 0:
            _fill_before(paths["disk"], rekey_module, "write_manifest")
        if fault.startswith(f"rank {rank} killed "):
            _die_at(fault.split(" killed ")[1], session_module)
        model = checkpoint_module([paths["base"]])
        began = time.monotonic()
        stats = lora_cache.merge(model, [paths["adapter"]], cache_root=paths["root"], progress=False,
                                 rank_timeout=RANK_TIMEOUT)
        served, expected = weights(model), load_file(paths["reference"])
        results = {"equal": all(served[n].equal(t) for n, t in expected.items()) and served.keys() == expected.keys(),
                   "built": stats.built, "in_place": stats.in_place, "fallen_back": stats.fallen_back,
                   "seconds": time.monotonic() - began}
    except Exception as exc:  # noqa: BLE001 - what it raised is what the test checks
        results = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    report_rank(folder, rank, results, leave="error" not in results)
    sys.stderr.flush()
    if "error" in results:  # its group is broken: leave without tearing gloo down
        os._exit(0)


def _world(tmp_path):
    from tests.conftest import write_safetensors

    world = make_world(tmp_path / "world")
    expected = reference(world.base, world.adapter)
    ref = write_safetensors(world.path("reference.safetensors"), expected)
    return world, expected, {"base": world.base, "adapter": world.adapter, "reference": ref}


def _said(folder, rank: int) -> str:
    with open(folder / f"rank{rank}.err") as handle:
        return handle.read()


@pytest.mark.parametrize("fault", FULL_DISK_AT)
def test_a_full_disk_in_a_shared_build_merges_in_place_on_every_rank_and_the_next_start_builds(tmp_path, fault):
    world, expected, paths = _world(tmp_path)
    out = tmp_path / "ranks"
    out.mkdir()
    with small_disk(tmp_path) as disk:
        paths.update(disk=disk, root=os.path.join(disk, "root"))
        Vault(paths["root"])  # the root and its cache folder made by an earlier start
        filler = fill(disk) if fault == "full from the start" else None
        results = spawn_ranks(_rank_main, 2, paths, out, fault)
        for rank, found in enumerate(results):
            said = _said(out, rank)
            assert "error" not in found, (rank, found, said)
            assert found["equal"] and found["built"] == 0, (rank, found)
            assert found["in_place"] + found["fallen_back"] == LAYERS, (rank, found)
            assert said.count(FULL_DISK_WARNING) == 1 and FULL_DISK_AT[fault] in said, (rank, said)
            assert "Traceback" not in said, (rank, said)
        root = paths["root"]
        assert markers(root) == [] and leftovers(root) == []
        os.unlink(filler or os.path.join(disk, "filler"))
        CONTENT_HASH_MEMO.clear()
        served, stats = start(world.base, world.adapter, root)
        assert_same(served, expected)
        assert stats.built == LAYERS, stats
        served, stats = start(world.base, world.adapter, root)
        assert stats.hit == LAYERS


def _spawn_with_a_death(paths: dict, folder, world: int, victim: int, step: str = "in its share") -> dict[int, dict]:
    """Run :func:`_rank_main` on ``world`` ranks of which ``victim`` is SIGKILLed at ``step``;
    what each survivor wrote."""
    from tests.fresh_fork import rank_context, with_parent_stdio
    from tests.lora_cache.test_shared_build import _free_port

    context, port = rank_context(), _free_port()
    ranks = [context.Process(target=with_parent_stdio(_rank_main), args=(rank, world, port, paths, str(folder),
                                                      f"rank {victim} killed {step}"))
             for rank in range(world)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=240)
    assert ranks[victim].exitcode == -signal.SIGKILL, [p.exitcode for p in ranks]
    found = {}
    for rank in range(world):
        if rank != victim:
            with open(folder / f"rank{rank}.json") as handle:
                found[rank] = json.load(handle)
    return found


def _named_and_in_place(found: dict, folder, victim: int) -> None:
    """Every survivor named the dead rank (and its pid where it could know it) in its one
    warning, before any wait ran out, and served the in-place merge."""
    for rank, result in found.items():
        said = _said(folder, rank)
        assert "error" not in result, (rank, result, said)
        assert result["equal"] and result["seconds"] < RANK_TIMEOUT, (rank, result)
        assert said.count(FULL_DISK_WARNING) == 1 and f"rank {victim} (" in said and " died during " in said, said
        assert victim == 0 or f"rank {victim} (pid " in said, said  # rank 0's pid: where it published it
        (warned,) = [line for line in said.splitlines() if FULL_DISK_WARNING in line]  # torch logs its own too
        assert "Broken pipe" not in warned.split("torch said:")[0] and "Traceback" not in said, said


def _another_adapter(world) -> str:
    """An adapter on the same base, unlike ``world``'s: a start with it hashes the base."""
    changes = {f"blocks.{i}.proj": lora_change(ROWS, COLS, 4, 10 + i) for i in range(LAYERS)}
    return write_adapter(world.path("other.safetensors"), "comfyui", changes)


@pytest.mark.parametrize("victim, then", [(0, "resumed"), (1, "removed")])
def test_every_rank_names_the_rank_killed_in_its_share_and_later_starts_resume_or_remove_what_it_left(
        tmp_path, victim, then):
    world, expected, paths = _world(tmp_path)
    out = tmp_path / "ranks"
    out.mkdir()
    root = paths["root"] = str(tmp_path / "root")
    found = _spawn_with_a_death(paths, out, 3, victim)
    _named_and_in_place(found, out, victim)
    (left,) = [os.path.dirname(m) for m in markers(root)]  # the survivors' shares, marked resumable
    CONTENT_HASH_MEMO.clear()
    if then == "removed":  # a start on the same base hashes it: no start builds under that provisional key again
        start(world.base, _another_adapter(world), root)
        Vault(root)  # the next start's sweep
        assert not os.path.lexists(left)
    served, stats = start(world.base, world.adapter, root)
    assert_same(served, expected)
    assert stats.hit > 0 if then == "resumed" else stats.built == LAYERS, stats
    assert markers(root) == [] and leftovers(root) == [] and not os.path.lexists(left)
    cache = os.path.join(root, "lora_merge_cache")
    assert stats.cache_key in os.listdir(cache) and len([n for n in os.listdir(cache) if len(n) == 64]) == (
        1 if then == "resumed" else 2), os.listdir(cache)


@pytest.mark.parametrize("step", ["before the exchange", "at the seal"])
@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_killed_before_the_exchange_or_at_the_seal_is_named_at_once_and_every_survivor_merges_in_place(
        tmp_path, step, victim):
    world, expected, paths = _world(tmp_path)
    out = tmp_path / "ranks"
    out.mkdir()
    root = paths["root"] = str(tmp_path / "root")
    found = _spawn_with_a_death(paths, out, 2, victim, step)
    _named_and_in_place(found, out, victim)
    CONTENT_HASH_MEMO.clear()
    served, _ = start(world.base, world.adapter, root)  # the next start builds, resumes or hits
    assert_same(served, expected)
    served, stats = start(world.base, world.adapter, root)
    assert_same(served, expected)
    assert stats.hit == LAYERS, stats
