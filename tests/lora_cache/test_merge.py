"""The merge math and the layer operations: identical bytes on both paths, exact unmerge."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import lora_cache
from hostmem import account
from lora_cache.compute.merge_math import (
    BF16_ADDMM,
    FP32_ROWS,
    Delta,
    Scratch,
    lora_scale,
    merged_weight,
    row_blocks,
    scratch_bytes,
    sums_in_output,
)
from tests.conftest import transparent_huge_pages, vma_holding, write_safetensors
from tests.lora_cache.test_adapters import lora_change, mapped_model, reference_merge, write_adapter

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CPU = torch.device("cpu")


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_within_dtype_tolerance(merged: torch.Tensor, reference: torch.Tensor) -> None:
    """One rounding to the dtype (half an ulp, |x| * eps bounds it) plus fp32 summation noise."""
    eps = torch.finfo(merged.dtype).eps
    error = (merged.double() - reference).abs()
    bound = eps * reference.abs() + 1e-5
    assert bool((error <= bound).all()), f"max error {float(error.max()):.3g} beyond the {merged.dtype} bound"


def _in_dtype(change: dict, dtype: torch.dtype) -> dict:
    """The same change with its factors stored in ``dtype`` (trainers ship bf16 or fp32)."""
    return {k: v.to(dtype) if k in ("up", "down") else v for k, v in change.items()}


def _adapter(tmp_path, name="a", seed=1, fmt="kohya", factors=torch.float32):
    changes = {
        "blocks.0.attn.to_q": lora_change(64, 64, 8, seed, alpha=4),
        "blocks.1.ff.proj_in": lora_change(128, 64, 8, seed + 1, alpha=16),
        "patch_embed": lora_change(64, 4, 4, seed + 2, alpha=4, conv=(2, 2)),
    }
    changes = {module: _in_dtype(change, factors) for module, change in changes.items()}
    suffix = "" if fmt == "peft" else ".safetensors"
    return write_adapter(tmp_path / f"{name}{suffix}", fmt, changes), changes


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_merged_weight_matches_an_independent_fp64_merge(dtype):
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(96, 48, generator=gen).to(dtype)
    first, second = lora_change(96, 48, 8, 1), lora_change(96, 48, 4, 2)
    diff = torch.randn(96, 48, generator=gen) * 0.01
    deltas = [
        Delta("a", first["up"], first["down"], lora_scale(0.8, 16, 8)),
        Delta("b", second["up"], second["down"], lora_scale(1.0, None, 4), diff, 0.5),
    ]
    out = merged_weight(base, deltas, torch.empty_like(base), Scratch("cpu"))
    reference = reference_merge(base, [(1.6, first), (1.0, {**second, "diff": diff, "strength": 0.5})])
    _assert_within_dtype_tolerance(out, reference)
    wrong = reference_merge(base, [(1.6, first)])
    assert not bool(((out.double() - wrong).abs() <= torch.finfo(dtype).eps * wrong.abs() + 1e-5).all())


def test_a_layer_of_many_row_blocks_merges_to_the_same_bytes_on_any_number_of_threads():
    """12 MiB of fp32 rows sums in 3 cache-sized blocks; workers, or none, or in place, same bytes."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(1536, 2048, generator=gen).to(torch.bfloat16)
    change = lora_change(1536, 2048, 16, 4)
    diff = torch.randn(1536, 2048, generator=gen) * 0.01
    deltas = [Delta("a", change["up"], change["down"], lora_scale(1.0, 8, 16), diff, 0.25)]
    blocks = row_blocks(tuple(base.shape), torch.device("cpu"))
    assert len(blocks) == 3 and blocks[0] == slice(0, 512) and blocks[-1].stop == 1536
    one = merged_weight(base, deltas, torch.empty_like(base), Scratch("cpu"))
    with ThreadPoolExecutor(3) as workers:
        spread = merged_weight(base, deltas, torch.empty_like(base), Scratch("cpu"), workers=workers)
    in_place = base.clone()
    merged_weight(in_place, deltas, in_place, Scratch("cpu"))
    assert torch.equal(one, spread) and torch.equal(one, in_place)
    _assert_within_dtype_tolerance(one, reference_merge(base, [(0.5, change), (1.0, {"diff": diff, "strength": 0.25})]))
    assert row_blocks((1536, 2048), torch.device("meta")) == [slice(0, 1536)]  # off the CPU: one block


@pytest.mark.parametrize("kernel", [BF16_ADDMM, FP32_ROWS])
def test_each_kernel_gives_the_same_bytes_on_any_number_of_threads_and_in_place(kernel):
    """A bf16 base and one bf16 adapter, the case with two kernels: each gives its own bytes
    whatever the threads (compared bit for bit), within the bf16 bound of the fp64 answer;
    the one-pass kernel takes no fp32 temporary, the fp32 one a block per worker at most."""
    base = torch.randn(1536, 2048, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)  # 3 row blocks
    change = _in_dtype(lora_change(1536, 2048, 16, 4), torch.bfloat16)
    deltas = [Delta("a", change["up"], change["down"], lora_scale(1.0, 8, 16))]
    out, scratch = torch.empty_like(base), Scratch("cpu")
    assert sums_in_output(base, deltas, out, CPU, kernel) == (kernel == BF16_ADDMM)
    one = merged_weight(base, deltas, out, scratch, kernel=kernel)
    assert scratch.nbytes == (0 if kernel == BF16_ADDMM else 4 << 20)  # one fp32 block, not the layer
    with ThreadPoolExecutor(3) as workers:
        spread = merged_weight(base, deltas, torch.empty_like(base), Scratch("cpu"), workers=workers, kernel=kernel)
        assert scratch_bytes(tuple(base.shape), CPU, workers) == 3 * (4 << 20)
    in_place = base.clone()
    merged_weight(in_place, deltas, in_place, Scratch("cpu"), kernel=kernel)
    bits = one.view(torch.int16)
    assert torch.equal(bits, spread.view(torch.int16)) and torch.equal(bits, in_place.view(torch.int16))
    _assert_within_dtype_tolerance(one, reference_merge(base, [(0.5, change)]))


def test_the_two_kernels_agree_within_one_rounding():
    """They order the rank's products differently, so a few elements may round the other way
    (which is why the key names the kernel); both are within the bf16 bound of the fp64 answer."""
    gen = torch.Generator().manual_seed(8)
    base = torch.randn(2048, 1536, generator=gen).to(torch.bfloat16)
    change = _in_dtype(lora_change(2048, 1536, 32, 2), torch.bfloat16)
    deltas = [Delta("a", change["up"], change["down"], 0.7)]
    one_pass = merged_weight(base, deltas, torch.empty_like(base), Scratch("cpu"), kernel=BF16_ADDMM)
    fp32 = merged_weight(base, deltas, torch.empty_like(base), Scratch("cpu"), kernel=FP32_ROWS)
    reference = reference_merge(base, [(0.7, change)])
    _assert_within_dtype_tolerance(one_pass, reference)
    _assert_within_dtype_tolerance(fp32, reference)
    assert int((one_pass.view(torch.int16) != fp32.view(torch.int16)).sum()) < base.numel() // 1000


def test_what_is_not_one_bf16_adapter_on_a_bf16_base_sums_in_the_fp32_temporary():
    base = torch.zeros(64, 32, dtype=torch.bfloat16)
    change = _in_dtype(lora_change(64, 32, 4, 1), torch.bfloat16)
    lora = Delta("a", change["up"], change["down"], 1.0)
    out = torch.empty_like(base)
    assert sums_in_output(base, [lora], out, CPU)
    assert not sums_in_output(base, [lora, lora], out, CPU)  # two adapters round once, after both
    assert not sums_in_output(base, [Delta("a", change["up"], change["down"], 1.0, base.float(), 1.0)], out, CPU)
    assert not sums_in_output(base, [Delta("a", change["up"].float(), change["down"].float(), 1.0)], out, CPU)
    assert not sums_in_output(base.half(), [lora], out.half(), CPU)  # only bf16 bases
    assert not sums_in_output(base, [lora], torch.empty(32, 64, dtype=torch.bfloat16).t(), CPU)  # strided out
    assert not sums_in_output(base, [lora], out, torch.device("meta"))  # a GPU sums in its fp32 temporary


def test_the_one_pass_merge_rounds_once_as_the_fp32_sum_does():
    """1 + 0.5 * (2**-7 + 2**-15) is just above the midpoint of bf16's 1 and 1 + 2**-7: rounded
    once it is the upper one; a kernel that rounded the product to bf16 first would give 1."""
    base = torch.ones(512, 1024, dtype=torch.bfloat16)
    up, down = torch.zeros(512, 64, dtype=torch.bfloat16), torch.zeros(64, 1024, dtype=torch.bfloat16)
    up[:, :2] = 1
    down[0], down[1] = 2.0**-7, 2.0**-15
    one_pass = [Delta("tie", up, down, 0.5)]
    assert sums_in_output(base, one_pass, torch.empty_like(base), CPU)
    merged = merged_weight(base, one_pass, torch.empty_like(base), Scratch("cpu"), kernel=BF16_ADDMM)
    fp32 = merged_weight(base, [Delta("tie", up.float(), down.float(), 0.5)], torch.empty_like(base), Scratch("cpu"))
    assert bool((merged == 1 + 2.0**-7).all()) and torch.equal(merged, fp32)


def test_lora_scale_follows_alpha_over_rank_and_rslora():
    assert lora_scale(1.0, None, 16) == 1.0
    assert lora_scale(0.5, 32, 16) == 1.0
    assert lora_scale(1.0, 8, 16, rslora=True) == 2.0
    with pytest.raises(ValueError):
        lora_scale(1.0, 8, 0)


@pytest.mark.parametrize("factors", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cached_and_in_place_merges_are_identical(tmp_path, dtype, factors):
    model = mapped_model(tmp_path, dtype=dtype)
    adapter, _ = _adapter(tmp_path, factors=factors)
    stats = lora_cache.merge(model, [(adapter, 0.9)], cache_root=tmp_path / "cache", progress=False)
    assert stats.built == 3 and stats.hit == 0 and stats.fallen_back == 0
    cached = _weights(model)
    lora_cache.unmerge(model)
    stats = lora_cache.merge(model, [(adapter, 0.9)], progress=False, enabled=False)
    assert stats.in_place == 3 and stats.cache_key is None
    in_place = _weights(model)
    assert cached.keys() == in_place.keys()
    for name in cached:
        assert torch.equal(cached[name], in_place[name]), name


@pytest.mark.parametrize("fmt", ["peft", "kohya", "comfyui"])
def test_each_format_merges_onto_the_right_parameters(tmp_path, fmt):
    model = mapped_model(tmp_path, dtype=torch.bfloat16)
    before = _weights(model)
    adapter, changes = _adapter(tmp_path, fmt=fmt)
    spec = lora_cache.Adapter(adapter, 0.5, alpha=8.0)
    lora_cache.merge(model, [spec], cache_root=tmp_path / "cache", progress=False)
    after = _weights(model)
    targets = {f"{module}.weight": parts for module, parts in changes.items()}
    for name, weight in after.items():
        if name not in targets:
            assert torch.equal(weight, before[name]), f"{name} changed but no key targets it"
            continue
        rank = targets[name]["down"].shape[0]
        _assert_within_dtype_tolerance(weight, reference_merge(before[name], [(0.5 * 8.0 / rank, targets[name])]))
        assert not torch.equal(weight, before[name])


def test_two_adapters_compose_in_the_order_given(tmp_path):
    model = mapped_model(tmp_path)
    base = _weights(model)["blocks.0.attn.to_q.weight"]
    a, a_changes = _adapter(tmp_path, "a", seed=1)
    b, b_changes = _adapter(tmp_path, "b", seed=7, fmt="comfyui")
    lora_cache.merge(model, [(a, 1.0), (b, -0.5)], cache_root=tmp_path / "cache", progress=False)
    both = model.blocks[0].attn.to_q.weight.detach()
    key = "blocks.0.attn.to_q"
    reference = reference_merge(base, [(4 / 8, a_changes[key]), (-0.5 * 4 / 8, b_changes[key])])
    _assert_within_dtype_tolerance(both, reference)
    lora_cache.unmerge(model)
    lora_cache.merge(model, [(a, 1.0)], progress=False, enabled=False)
    assert not torch.equal(model.blocks[0].attn.to_q.weight, both)


def test_diff_and_diff_b_are_added_with_the_strength(tmp_path):
    model = mapped_model(tmp_path)
    before = _weights(model)
    diff, diff_b = torch.randn(64), torch.randn(64)
    path = write_adapter(tmp_path / "d.safetensors", "comfyui", {"blocks.1.norm": {"diff": diff, "diff_b": diff_b}})
    lora_cache.merge(model, [(path, 0.25)], cache_root=tmp_path / "cache", progress=False)
    assert torch.equal(model.blocks[1].norm.weight, before["blocks.1.norm.weight"] + 0.25 * diff)
    assert torch.equal(model.blocks[1].norm.bias, before["blocks.1.norm.bias"] + 0.25 * diff_b)


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "in_place"])
def test_unmerge_restores_the_base_bit_for_bit(tmp_path, cached):
    model = mapped_model(tmp_path, dtype=torch.bfloat16)
    originals = {n: p for n, p in model.named_parameters()}
    before = _weights(model)
    adapter, _ = _adapter(tmp_path)
    root = tmp_path / "cache" if cached else None
    lora_cache.merge(model, [(adapter, 1.0)], cache_root=root, progress=False)  # no copy asked: none needed
    assert lora_cache.is_merged(model)
    assert not torch.equal(model.blocks[0].attn.to_q.weight, before["blocks.0.attn.to_q.weight"])
    assert lora_cache.unmerge(model) == 3
    assert not lora_cache.is_merged(model)
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name
        assert param is originals[name], f"{name}: the read-only base was never written; unmerge reinstalls it"


def test_unmerge_of_a_writable_base_copies_the_snapshot_back(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64)).to(torch.bfloat16)  # heap weights
    before, storage = model[0].weight.detach().clone(), model[0].weight.data_ptr()
    adapter = write_adapter(tmp_path / "a.safetensors", "comfyui", {"0": lora_change(64, 64, 4, 1)})
    lora_cache.merge(model, [adapter], progress=False, enabled=False, unmergeable=True)
    assert model[0].weight.data_ptr() == storage and not torch.equal(model[0].weight, before)
    lora_cache.unmerge(model)
    assert model[0].weight.data_ptr() == storage and torch.equal(model[0].weight, before)


def test_an_in_place_merge_without_a_copy_cannot_be_unmerged_and_says_how_to_merge_instead(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).to(torch.bfloat16)
    adapter = write_adapter(tmp_path / "a.safetensors", "comfyui", {"0": lora_change(64, 64, 4, 1)})
    storage = model[0].weight.data_ptr()
    lora_cache.merge(model, [adapter], progress=False, enabled=False)
    merged = model[0].weight.detach().clone()
    assert model[0].weight.data_ptr() == storage  # summed where it lies, as peft's merge does
    with pytest.raises(lora_cache.UnmergeError, match=r"1 weight\(s\) .*\(0.weight\).*unmergeable=True"):
        lora_cache.unmerge(model)
    assert lora_cache.is_merged(model) and torch.equal(model[0].weight, merged)  # left as it was
    with pytest.raises(ValueError, match="already merged"):
        lora_cache.merge(model, [adapter], progress=False, enabled=False)


def test_cached_merge_installs_file_backed_views_and_in_place_installs_anonymous(tmp_path):
    model = mapped_model(tmp_path, dim=256)
    adapter = write_adapter(tmp_path / "a.safetensors", "kohya", {"blocks.0.ff.proj_in": lora_change(512, 256, 8, 1)})
    lora_cache.merge(model, [adapter], cache_root=tmp_path / "cache", progress=False)
    weight = model.blocks[0].ff.proj_in.weight
    assert not weight.requires_grad and float(weight.sum()) == float(weight.sum())  # touch every page
    entry = account(model).components["model"].parameters["blocks.0.ff.proj_in.weight"]
    assert entry.residency.anonymous == 0 and entry.residency.file_backed == weight.nbytes
    lora_cache.unmerge(model)
    lora_cache.merge(model, [adapter], progress=False, enabled=False)
    entry = account(model).components["model"].parameters["blocks.0.ff.proj_in.weight"]
    assert entry.residency.anonymous == weight.nbytes


def test_merging_a_merged_model_again_is_refused(tmp_path):
    model = mapped_model(tmp_path)
    adapter, _ = _adapter(tmp_path)
    lora_cache.merge(model, [adapter], progress=False, enabled=False)
    with pytest.raises(ValueError, match=r"already merged; call lora_cache.unmerge\(model\)"):
        lora_cache.merge(model, [adapter], progress=False, enabled=False)


def test_a_conv_lora_with_a_spatial_up_kernel_is_refused_before_anything_merges(tmp_path):
    model = mapped_model(tmp_path)
    before = _weights(model)
    changes = {
        "blocks.0.attn.to_q": lora_change(64, 64, 2, 1),
        "patch_embed": {"down": torch.randn(2, 4, 2, 2), "up": torch.randn(64, 2, 2, 2)},
    }
    path = write_adapter(tmp_path / "c.safetensors", "kohya", changes)
    with pytest.raises(lora_cache.UnsupportedAdapterError, match=r"lora_up.weight'.*\(2, 2\) up kernel"):
        lora_cache.merge(model, [path], progress=False, enabled=False)
    assert not lora_cache.is_merged(model)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_a_quantized_base_is_refused_naming_the_parameter(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    model[0].weight = torch.nn.Parameter(torch.zeros(64, 64, dtype=torch.int8), requires_grad=False)
    path = write_adapter(tmp_path / "q.safetensors", "comfyui", {"0": lora_change(64, 64, 4, 1)})
    with pytest.raises(ValueError, match=r"changes '0.weight', which is torch.int8: .*floating-point weights only"):
        lora_cache.merge(model, [path], progress=False, enabled=False)


def test_the_merge_buffer_is_a_mapping_of_its_own_on_huge_pages_and_goes_back_when_released():
    scratch = Scratch("cpu")
    view = scratch.take((3 << 20,), torch.float32)  # 12 MiB
    view.fill_(1.0)
    address = view.data_ptr()
    assert address % (2 << 20) == 0
    vma = vma_holding(address)
    assert vma is not None and not vma.is_file and not vma.is_shared
    assert vma.anonymous >= view.nbytes  # counted where the tracker looks: anonymous memory
    if transparent_huge_pages():
        assert "hg" in vma.vm_flags  # advised for transparent huge pages
    if transparent_huge_pages() in ("always", "madvise"):
        assert vma.anon_huge_pages >= 2 << 20, f"no huge page in a 12 MiB advised buffer: {vma}"
    del view
    scratch.release()
    assert vma_holding(address) is None  # unmapped, not kept by an allocator


def test_an_in_place_merge_never_copies_an_untouched_private_mapping_and_sums_a_copied_one_where_it_lies(tmp_path):
    """safetensors' own loader maps the file private and writable: summing into it would copy
    every page on write, so an untouched layer gets a new tensor (the same bytes, the file's
    pages left as they were, the base its own snapshot), while a layer whose pages the process
    already copied is summed where it lies. Both give the bytes a heap model's merge gives."""
    from safetensors import safe_open

    from hostmem.pagemap import PagemapReader
    from lora_cache.placement.layers import module_tree

    torch.manual_seed(0)
    layers = {f"blocks.{i}.proj.weight": torch.randn(256, 512).to(torch.bfloat16) for i in range(2)}
    base = write_safetensors(tmp_path / "base.safetensors", layers)
    changes = {f"blocks.{i}.proj": lora_change(256, 512, 8, i, alpha=4) for i in range(2)}
    adapter = write_adapter(tmp_path / "a.safetensors", "comfyui", changes)
    with safe_open(base, framework="pt") as handle:
        model = module_tree([(name, handle.get_tensor(name)) for name in handle.keys()])
    heap = module_tree([(name, p.detach().clone()) for name, p in model.named_parameters()])
    untouched, copied = model.get_parameter('blocks.0.proj.weight'), model.get_parameter('blocks.1.proj.weight')
    with torch.no_grad():
        copied.mul_(1)  # writes every page of layer 1: the process's own copies now, the same values
    pages = PagemapReader()
    extent = {name: (p.data_ptr(), p.data_ptr() + p.nbytes) for name, p in (("0", untouched), ("1", copied))}
    shared = pages.private_copies(*extent["0"])
    assert shared <= 1 and pages.private_copies(*extent["1"]) == -(-copied.nbytes // 4096) + 1  # a page each side

    lora_cache.merge(model, [adapter], enabled=False, progress=False)
    lora_cache.merge(heap, [adapter], enabled=False, progress=False)
    assert model.get_parameter('blocks.0.proj.weight').data_ptr() != extent["0"][0]  # a new tensor
    assert pages.private_copies(*extent["0"]) == shared  # the file's pages were never written (one it shares
    # with layer 1, at the boundary, is layer 1's copy)
    assert model.get_parameter('blocks.1.proj.weight').data_ptr() == extent["1"][0]  # summed where it lies
    for i in range(2):
        assert torch.equal(model.get_parameter(f'blocks.{i}.proj.weight'), heap.get_parameter(f'blocks.{i}.proj.weight')), i
    _assert_within_dtype_tolerance(model.get_parameter('blocks.0.proj.weight'),
                                   reference_merge(layers["blocks.0.proj.weight"], [(0.5, changes["blocks.0.proj"])]))
    assert lora_cache.unmerge(model, strict=False) == 1  # the untouched base is its own snapshot
    assert model.get_parameter('blocks.0.proj.weight') is untouched and torch.equal(untouched, layers["blocks.0.proj.weight"])
    pages.close()
