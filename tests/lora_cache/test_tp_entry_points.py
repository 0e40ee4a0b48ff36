"""Tensor-parallel parts beyond ``lora_cache.merge``: ``hostmem lora merge --shard`` builds a
rank's parts ahead of time (its servers then only hit), and ``lora_cache.set_adapters``
with ``shards=`` switches the ranks of a gloo group together, each to its part of a
single-process merge, to the base and back from the cache.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import traceback

import pytest

import lora_cache
from lora_cache.ranks.tp_shards import ShardSpecError, parse_shard_args
from planners.cli import main
from tests.conftest import write_lora_config
from tests.lora_cache.test_shared_build import RANK_TIMEOUT, report_rank, spawn_ranks
from tests.lora_cache.test_tp_shards import DEGREE, compare, inputs, rank_model, spec  # noqa: F401 (a fixture)


def _config(tmp_path, paths: dict) -> str:
    return write_lora_config(tmp_path, paths["base"], paths["adapter"], name="tp-test")


def _shard_args(rank: int) -> list[str]:
    return [f"--shard={name}={':'.join(map(str, part))}" for name, part in spec(rank).items()]


def test_hostmem_lora_merge_builds_each_ranks_parts_and_its_servers_only_hit(inputs, tmp_path, capsys):
    config = _config(tmp_path, inputs)
    for rank in range(DEGREE):
        assert main(["lora", "merge", config, "--json", *_shard_args(rank)]) == 0
        built = json.loads(capsys.readouterr().out)
        assert built["built"] > 0 and len(built["shard_keys"]) == 1, built
        model = rank_model(inputs["base"], rank)  # the server's start of this rank
        stats = lora_cache.merge(model, [inputs["adapter"]], cache_root=tmp_path / "cache", progress=False,
                                 shards=spec(rank))
        assert (stats.built, stats.hit) == (0, stats.layers) and stats.shard_keys == built["shard_keys"]
        assert stats.cache_key == built["cache_key"] and compare(model, inputs["reference"], rank) == []


@pytest.mark.parametrize("arg,message", [
    ("--shard=blocks.0.proj_in.weight=0:1", r"--shard 'blocks.0.proj_in.weight=0:1': expected --shard "
                                            r"NAME=DIM:INDEX:COUNT"),
    ("--shard=blocks.0.proj_in.weight", r"expected --shard NAME=DIM:INDEX:COUNT, e.g."),
    ("--shard=blocks.0.proj_in.weight=0:2:2", r"--shard 'blocks.0.proj_in.weight=0:2:2': .*index 2 is not a part"),
    ("--shard=blocks.0.proj_inn.weight=0:0:2", r"--shard: .*has no parameter of that name"),
    ("--shard=blocks.0.proj_in.weight=0:0:3", r"has 128 along dim 0 in the checkpoint, which does not split into 3"),
])
def test_a_bad_shard_argument_is_named_and_builds_nothing(inputs, tmp_path, capsys, arg, message):
    assert main(["lora", "merge", _config(tmp_path, inputs), arg]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hostmem: error: ") and len(err.splitlines()) == 1, err
    assert re.search(message, err), err
    assert not list(tmp_path.rglob("*.safetensors")), "a layer was written"


def test_shard_arguments_parse_into_a_spec_and_a_name_given_twice_is_refused():
    assert parse_shard_args(["a.weight=0:1:4", "b.weight=1:0:2"]) == {"a.weight": (0, 1, 4), "b.weight": (1, 0, 2)}
    with pytest.raises(ShardSpecError, match=r"--shard 'a.weight=1:0:2': 'a.weight' is given twice"):
        parse_shard_args(["a.weight=0:1:4", "a.weight=1:0:2"])


def _switch_ranks(rank: int, world: int, port: int, paths: dict, folder: str) -> None:
    """One rank: switch to the adapter (built by the ranks together), to the base, back (cached)."""
    import torch.distributed as dist

    results: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        model, root = rank_model(paths["base"], rank), os.path.join(folder, "cache")
        for step, adapters in (("first", [paths["adapter"]]), ("base", []), ("back", [paths["adapter"]])):
            switched = lora_cache.set_adapters(model, adapters, root, shards=spec(rank), rank_timeout=RANK_TIMEOUT)
            results[step] = {"mode": switched.mode, "layers": switched.layers,
                             "differ": compare(model, paths["reference"], rank)}
        dist.barrier()
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        results["crash"] = traceback.format_exc()
    report_rank(folder, rank, results)


def test_set_adapters_switches_two_gloo_ranks_to_their_parts_to_the_base_and_back_from_the_cache(inputs, tmp_path):
    results = spawn_ranks(_switch_ranks, DEGREE, inputs, tmp_path)
    for rank, found in enumerate(results):
        assert found["first"]["mode"] == "built" and found["first"]["differ"] == [], (rank, found)
        assert found["base"]["mode"] == "base" and found["base"]["differ"] != [], (rank, found)
        assert found["back"] == {**found["first"], "mode": "cached"}, (rank, found)
