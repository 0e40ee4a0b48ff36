"""Tensor-parallel shards: each rank holds a part of some weights and gets exactly that part
of a single-process merge, rows as a view of the whole merged layer's file, columns from
a per-shard file whose key names the sharding. Single-process cases first (shards given
explicitly), then two ranks over gloo (spawned processes) sharing one host's build.
"""

from __future__ import annotations

import datetime
import os
import traceback

import pytest
import torch

import lora_cache
from hostmem.safetensors.mapping import open_readonly
from hostmem.slots import MappedAreas
from lora_cache import KeyResolutionError
from lora_cache.placement.layers import checkpoint_module, module_tree
from lora_cache.compute.merge_math import BF16_ADDMM, FP32_ROWS, Delta, Scratch, merged_weight
from lora_cache.ranks.tp_shards import Shard, ShardSpecError
from lora_cache.ranks.tp_shards.shard_math import shard_merged
from tests.conftest import write_safetensors
from tests.lora_cache.test_adapters import lora_change, write_adapter
from tests.lora_cache.test_shared_build import RANK_TIMEOUT, report_rank, spawn_ranks

DIM, HIDDEN, DEPTH, DEGREE = 96, 128, 2, 2
COLUMN = [f"blocks.{i}.proj_in" for i in range(DEPTH)]  # out features split: rows of weight and bias
ROW = [f"blocks.{i}.proj_out" for i in range(DEPTH)]  # in features split: columns of weight; bias whole


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A bf16 checkpoint of column- and row-parallel Linear layers, an adapter on each
    (with bias deltas), and the single-process merge of the two: the reference."""
    folder = tmp_path_factory.mktemp("tp-shards")
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(DEPTH):
        tensors[f"blocks.{i}.proj_in.weight"] = torch.randn(HIDDEN, DIM, generator=gen)
        tensors[f"blocks.{i}.proj_in.bias"] = torch.randn(HIDDEN, generator=gen)
        tensors[f"blocks.{i}.proj_out.weight"] = torch.randn(DIM, HIDDEN, generator=gen)
        tensors[f"blocks.{i}.proj_out.bias"] = torch.randn(DIM, generator=gen)
    base = write_safetensors(folder / "base.safetensors", {n: t.bfloat16() for n, t in tensors.items()})
    changes = {}
    for i, module in enumerate(COLUMN + ROW):
        out, inp = (HIDDEN, DIM) if module in COLUMN else (DIM, HIDDEN)
        changes[module] = {**lora_change(out, inp, 8, i, alpha=4),
                           "diff_b": torch.randn(out, generator=gen) * 0.01}
    adapter = write_adapter(folder / "turbo.safetensors", "comfyui", changes)
    model = checkpoint_module([base])
    lora_cache.merge(model, [adapter], cache_root=str(folder / "single"), progress=False)
    reference = write_safetensors(folder / "reference.safetensors",
                                  {n: p.detach().clone() for n, p in model.named_parameters()})
    return {"base": base, "adapter": adapter, "reference": reference}


def spec(rank: int, degree: int = DEGREE) -> dict:
    """What a server passes: its column-parallel weights and biases by rows, row-parallel by columns."""
    shards = {}
    for module in COLUMN:
        shards[f"{module}.weight"] = (0, rank, degree)
        shards[f"{module}.bias"] = (0, rank, degree)
    for module in ROW:
        shards[f"{module}.weight"] = (1, rank, degree)
    return shards


def part_of(tensor: torch.Tensor, shard) -> torch.Tensor:
    shard = Shard(*shard)
    return tensor.narrow(shard.dim, *(lambda s: (s.start, s.stop - s.start))(shard.bounds(tuple(tensor.shape))))


def rank_model(base: str, rank: int, degree: int = DEGREE, copy_parts: bool = False):
    """The model a rank loads: its parts as views of the mapped checkpoint (rows at an
    offset, columns strided; or copied out of it when ``copy_parts``), the rest whole."""
    mapped = open_readonly(base)
    shards = spec(rank, degree)
    tensors = []
    for name in mapped.keys():
        tensor = mapped.get_tensor(name)
        if name in shards:
            tensor = part_of(tensor, shards[name])
            if copy_parts:
                tensor = tensor.clone()
        tensors.append((name, tensor))
    return module_tree(tensors)


def compare(model, reference_path: str, rank: int, degree: int = DEGREE) -> list[str]:
    """The parameters that differ from their part of the single-process merge."""
    from safetensors.torch import load_file

    reference, shards = load_file(reference_path), spec(rank, degree)
    return [n for n, p in model.named_parameters()
            if not torch.equal(p, part_of(reference[n], shards[n]) if n in shards else reference[n])]


def mapped_path(tensor: torch.Tensor) -> str:
    area = MappedAreas().area_of(tensor)
    assert area is not None and area.is_file, "not a view of a mapped file"
    return area.path


def layouts(model) -> dict:
    """Where each part lives: the combination folder (key) of its mapped file, and whether
    it spans the whole layer's file."""
    found = {}
    for name, param in model.named_parameters():
        path = mapped_path(param)
        found[name] = {"key": os.path.basename(os.path.dirname(path)), "path": path,
                       "file_bytes": param.untyped_storage().nbytes()}
    return found


# ----------------------------------------------------------------- one process


def test_each_part_equals_its_part_of_a_single_process_merge_rows_mapped_from_the_whole_file(inputs, tmp_path):
    root = str(tmp_path / "cache")
    full_keys, shard_keys = set(), set()
    for rank in range(DEGREE):
        model = rank_model(inputs["base"], rank, copy_parts=rank == 1)  # rank 1: whole rows found by name
        stats = lora_cache.merge(model, [inputs["adapter"]], cache_root=root, progress=False,
                                 base_files=[inputs["base"]], shards=spec(rank))
        assert compare(model, inputs["reference"], rank) == []
        where = layouts(model)
        for module in COLUMN:  # rows: the whole merged layer's file, same key as a single-process merge
            for attr, whole in (("weight", HIDDEN * DIM * 2), ("bias", HIDDEN * 2)):
                assert where[f"{module}.{attr}"]["key"] == stats.cache_key
                assert where[f"{module}.{attr}"]["file_bytes"] == whole
        sharding = Shard(1, rank, DEGREE).describe()
        assert list(stats.shard_keys) == [sharding] and stats.shard_keys[sharding] != stats.cache_key
        for module in ROW:  # columns: a per-shard file; its whole bias: the whole layer's combination
            assert where[f"{module}.weight"]["key"] == stats.shard_keys[sharding]
            assert where[f"{module}.weight"]["file_bytes"] == DIM * HIDDEN // DEGREE * 2
            assert where[f"{module}.bias"]["key"] == stats.cache_key
        full_keys.add(stats.cache_key)
        shard_keys.add(stats.shard_keys[sharding])
        assert stats.layers == 4 * DEPTH  # rank 1 maps the whole layers rank 0 built, and builds its columns
        assert (stats.built, stats.hit) == ((4 * DEPTH, 0) if rank == 0 else (len(ROW), 4 * DEPTH - len(ROW)))
        lora_cache.unmerge(model)
        assert compare(model, inputs["reference"], rank) != []  # back to the base
    assert len(full_keys) == 1 and len(shard_keys) == DEGREE
    single = lora_cache.merge(checkpoint_module([inputs["base"]]), [inputs["adapter"]], cache_root=root,
                              progress=False)
    assert single.cache_key in full_keys  # the rows' combination is a single-process merge's


def test_a_second_start_hits_every_part_without_building(inputs, tmp_path):
    root = str(tmp_path / "cache")
    first = lora_cache.merge(rank_model(inputs["base"], 0), [inputs["adapter"]], cache_root=root, progress=False,
                             shards=spec(0))
    model = rank_model(inputs["base"], 0)
    again = lora_cache.merge(model, [inputs["adapter"]], cache_root=root, progress=False, shards=spec(0))
    assert first.built == first.layers and again.built == 0 and again.hit == again.layers == first.layers
    assert again.cache_key == first.cache_key and again.shard_keys == first.shard_keys
    assert compare(model, inputs["reference"], 0) == []


def test_in_place_each_part_still_equals_its_part(inputs):
    model = rank_model(inputs["base"], 1, copy_parts=True)
    stats = lora_cache.merge(model, [inputs["adapter"]], enabled=False, progress=False, shards=spec(1))
    assert stats.in_place == stats.layers and stats.cache_key is None
    assert compare(model, inputs["reference"], 1) == []


@pytest.mark.parametrize("dtype,kernel", [(torch.float32, FP32_ROWS), (torch.bfloat16, FP32_ROWS),
                                          (torch.bfloat16, BF16_ADDMM)])
def test_a_part_summed_alone_matches_the_whole_layer_over_several_row_blocks(dtype, kernel):
    """A shape where a part's own product differed from the whole one's here (fp32: the last
    row part and every column part, summed alone, differ in the last bit of some elements):
    several row blocks of 341 rows, parts that cross block edges."""
    gen = torch.Generator().manual_seed(1)
    rows, cols, rank, count = 1024, 3072, 64, 4
    base = torch.randn(rows, cols, generator=gen).to(dtype)
    up = torch.randn(rows, rank, generator=gen).to(dtype)
    down = (torch.randn(rank, cols, generator=gen) / cols**0.5).to(dtype)
    diff = None if kernel == BF16_ADDMM else torch.randn(rows, cols, generator=gen).to(dtype) * 0.01
    delta = Delta("test", up, down, 0.7, diff=diff)
    whole = merged_weight(base, [delta], torch.empty_like(base), Scratch("cpu"), kernel=kernel)
    for dim in (0, 1):
        for index in range(count):
            shard = Shard(dim, index, count)
            held = part_of(base, shard)
            got = shard_merged(held, [delta], shard, torch.empty(held.shape, dtype=dtype), Scratch("cpu"),
                               kernel=kernel)
            assert torch.equal(got, part_of(whole, shard)), shard


def test_rows_of_a_checkpoint_saved_already_sharded_are_merged_apart_and_still_equal(inputs, tmp_path):
    """A rank loaded from its own part-checkpoint has no whole weight to merge: its rows
    go to a per-shard file too."""
    mapped = open_readonly(inputs["base"])
    shards = spec(1)
    parts = {n: part_of(mapped.get_tensor(n), shards[n]).contiguous() if n in shards else mapped.get_tensor(n)
             for n in mapped.keys()}
    own = write_safetensors(tmp_path / "rank1.safetensors", parts)
    model = checkpoint_module([own])
    stats = lora_cache.merge(model, [inputs["adapter"]], cache_root=str(tmp_path / "c"), progress=False,
                             shards=shards)
    assert compare(model, inputs["reference"], 1) == []
    assert sorted(stats.shard_keys) == sorted({Shard(0, 1, DEGREE).describe(), Shard(1, 1, DEGREE).describe()})
    where = layouts(model)
    assert where[f"{COLUMN[0]}.weight"]["key"] == stats.shard_keys[Shard(0, 1, DEGREE).describe()]


# ----------------------------------------------------------------- wrong specs


@pytest.mark.parametrize("shards,message", [
    ({"blocks.0.proj_in": (0, 0, 2)}, r"names a module, not a parameter: .*'blocks.0.proj_in.bias'"),
    ({"blocks.0.proj_inn.weight": (0, 0, 2)}, r"has no parameter of that name"),
    ({"blocks.0.proj_in.weight": (0, 2, 2)}, r"index 2 is not a part of 2"),
    ({"blocks.0.proj_in.weight": (0, 0)}, r"expected \(dim, index, count\) as three integers"),
    ({"blocks.0.proj_in.bias": (1, 0, 2)}, r"dim 1 cannot be split for a parameter of shape \(64,\)"),
    ([("blocks.0.proj_in.weight", (0, 0, 2))], r"shards=list: expected a mapping"),
])
def test_a_malformed_spec_names_the_parameter_and_merges_nothing(inputs, tmp_path, shards, message):
    model = rank_model(inputs["base"], 0)
    with pytest.raises(ShardSpecError, match=message):
        lora_cache.merge(model, [inputs["adapter"]], cache_root=str(tmp_path / "c"), progress=False, shards=shards)
    assert not lora_cache.is_merged(model) and not (tmp_path / "c").exists()


def test_a_count_that_does_not_fit_the_adapter_says_what_the_spec_claimed(inputs, tmp_path):
    shards = {**spec(0), "blocks.1.proj_out.weight": (1, 0, 4)}
    with pytest.raises(KeyResolutionError, match=r"shards= says this rank holds part 0 of 4 along dim 1"):
        lora_cache.merge(rank_model(inputs["base"], 0), [inputs["adapter"]], cache_root=str(tmp_path / "c"),
                         progress=False, shards=shards)


def test_a_part_that_lies_elsewhere_in_the_checkpoint_than_the_spec_says_is_refused(inputs, tmp_path):
    model = rank_model(inputs["base"], 0)  # holds part 0 of every split weight
    with pytest.raises(ShardSpecError, match=r"not the start of part 1 of 2 along dim 0 but of part 0"):
        lora_cache.merge(model, [inputs["adapter"]], cache_root=str(tmp_path / "c"), progress=False, shards=spec(1))
    assert not lora_cache.is_merged(model)


# ----------------------------------------------------------------- two ranks


def _rank_main(rank: int, world: int, port: int, paths: dict, folder: str) -> None:
    """One rank: a first start (the host's shared build), a second start, a wrong spec."""
    import torch.distributed as dist

    results: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        root = os.path.join(folder, "cache")
        for start in ("first", "second"):
            model = rank_model(paths["base"], rank)
            stats = lora_cache.merge(model, [paths["adapter"]], cache_root=root, progress=False, shards=spec(rank),
                                     rank_timeout=RANK_TIMEOUT)
            results[start] = {"stats": stats.to_dict(), "differ": compare(model, paths["reference"], rank),
                              "where": layouts(model)}
            del model
        try:
            lora_cache.merge(rank_model(paths["base"], rank), [paths["adapter"]], cache_root=root, progress=False,
                             shards=spec(world - 1 - rank), rank_timeout=RANK_TIMEOUT)
        except ShardSpecError as exc:
            results["wrong"] = str(exc)
        dist.barrier()
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        results["crash"] = traceback.format_exc()
    report_rank(folder, rank, results)


def test_two_ranks_share_the_whole_layers_build_keep_their_own_columns_and_hit_after(inputs, tmp_path):
    results = spawn_ranks(_rank_main, DEGREE, inputs, tmp_path)
    whole_layers = 2 * len(COLUMN) + len(ROW)  # column weights and biases, row-parallel biases
    first = [r["first"] for r in results]
    assert all(f["differ"] == [] for f in first), [f["differ"] for f in first]
    built = [f["stats"]["built"] for f in first]
    assert sum(built) == whole_layers + DEGREE * len(ROW) and all(b > len(ROW) for b in built), built
    assert first[0]["stats"]["cache_key"] == first[1]["stats"]["cache_key"]
    shard_keys = [set(f["stats"]["shard_keys"].values()) for f in first]
    assert not shard_keys[0] & shard_keys[1] and first[0]["stats"]["cache_key"] not in shard_keys[0] | shard_keys[1]
    for module in COLUMN:  # both ranks map their rows of the one whole file
        paths = {f["where"][f"{module}.weight"]["path"] for f in first}
        assert len(paths) == 1, paths
    for module in ROW:
        paths = {f["where"][f"{module}.weight"]["path"] for f in first}
        assert len(paths) == DEGREE, paths
    for r in results:
        second = r["second"]["stats"]
        assert second["built"] == 0 and second["hit"] == second["layers"] and r["second"]["differ"] == []
        assert "not the start of part" in r["wrong"], r.get("wrong")


def test_a_rank_merge_that_fails_after_a_lossy_layer_was_kept_at_run_time_leaves_the_model_as_it_was(tmp_path):
    """The columns kept apart are merged last; a term refused there (DoRA on a column part)
    fails the merge after a lossy whole layer got its run-time terms: those come off too."""
    from tests.lora_cache.test_dora import _base, _dora_adapter

    model = _base(tmp_path, torch.bfloat16)
    dora, _ = _dora_adapter(tmp_path)
    gen = torch.Generator().manual_seed(3)
    lossy = write_adapter(tmp_path / "turbo.safetensors", "kohya",
                          {"c": {"up": torch.randn(32, 4, generator=gen) * 1e-2,
                                 "down": torch.randn(4, 32, generator=gen) * 1e-3, "alpha": torch.tensor(4.0)}})
    half = model.b.weight.detach().narrow(1, 0, 32)  # this rank's columns of b
    model.b._parameters["weight"] = torch.nn.Parameter(half, requires_grad=False)
    x = torch.randn(2, 32).bfloat16()
    before = model.c(x).clone()
    with pytest.raises(lora_cache.UnsupportedAdapterError, match="DoRA term on a part of the weight"):
        lora_cache.merge(model, [lossy, dora], cache_root=tmp_path / "cache", progress=False,
                         shards={"b.weight": (1, 0, 2)})
    assert not lora_cache.is_merged(model)
    assert list(model.c.named_children()) == [] and torch.equal(model.c(x), before)


def test_a_lossy_layer_on_a_rank_is_refused_or_merged_as_rounding_merge_merges_it(tmp_path):
    """A rank holds a part of a layer whose update rounds away in bf16: a part cannot carry
    run-time terms (it was listed at run time and never hooked: the update dropped without
    a word). Refused under the default policy; with ``rounding="merge"`` its part of that merge."""
    from hostmem.errors import InputError

    from torch import nn

    gen = torch.Generator().manual_seed(0)
    weight = (torch.rand(128, 64, generator=gen) + 1).bfloat16()  # in [1, 2): one bf16 step is 2**-7
    base = write_safetensors(tmp_path / "base.safetensors", {"proj.weight": weight})
    up = torch.randn(128, 4, generator=gen) * 1e-2
    down = torch.randn(4, 64, generator=gen) * 2.0**-10  # about a tenth of a step: lossy
    adapter = write_adapter(tmp_path / "small.safetensors", "kohya",
                            {"proj": {"up": up, "down": down, "alpha": torch.tensor(4.0)}})

    def model(rows=None):
        tensor = open_readonly(base).get_tensor("proj.weight")
        holder = nn.Module()
        holder.proj = nn.Linear(64, 128, bias=False)
        part = tensor if rows is None else tensor.narrow(0, rows * 64, 64)
        holder.proj._parameters["weight"] = nn.Parameter(part, requires_grad=False)
        return holder

    single = model()
    lora_cache.merge(single, [adapter], cache_root=tmp_path / "c1", rounding="merge", progress=False)
    for rank in (0, 1):
        part = model(rows=rank)
        before = part.proj.weight
        with pytest.raises(InputError, match=r"1 layer\(s\) of this tensor-parallel rank \(proj.weight\).*"
                                             r"rounding='merge'.*Nothing was merged"):
            lora_cache.merge(part, [adapter], cache_root=tmp_path / "c2", progress=False,
                             shards={"proj.weight": (0, rank, 2)})
        assert part.proj.weight is before and not lora_cache.is_merged(part)
        with pytest.warns(UserWarning, match="merged anyway"):
            stats = lora_cache.merge(part, [adapter], cache_root=tmp_path / "c2", progress=False,
                                     shards={"proj.weight": (0, rank, 2)}, rounding="merge")
        assert stats.rounding["policy"] == "merge" and stats.at_runtime == 0
        assert torch.equal(part.proj.weight, single.proj.weight.narrow(0, rank * 64, 64))
