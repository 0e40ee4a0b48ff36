"""A base the cache cannot key by its file: weights changed in memory after loading (a LoRA
fused in place), or views of a checkpoint replaced or removed since. Each is merged in
place with one warning, and the cache holds only what clean starts built."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import lora_cache
from lora_cache.placement.layers import AddressSpace
from tests.conftest import write_safetensors
from tests.lora_cache.test_orchestrate import _setup


def _privately_mapped(path, model):
    """``model`` with its weights loaded from ``path`` as safetensors' own loader hands them
    over: views of a private, writable mapping of the file, which a write copies page by page."""
    from safetensors.torch import load_file

    for name, tensor in load_file(str(path)).items():
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
    return model


def _fuse_in_place(model):
    """What diffusers' fuse_lora does to a weight: a sum into its own bytes (a few bf16 steps)."""
    weight = model.get_parameter("blocks.0.attn.to_q.weight")
    weight.data.add_(torch.full_like(weight, 2.0**-5))
    return model


def test_a_base_changed_in_memory_merges_in_place_and_is_never_keyed_by_its_file(tmp_path):
    """A weight summed into where it lies (a LoRA fused by diffusers) still names its file:
    keyed by it, a clean start's cache would serve the changed model the file's merge (the
    change lost), or the changed model's merge would be built under the clean key. Each
    start gets its own base plus the adapter, and the cache holds only clean builds."""
    from hostmem.vault.store import MEMO_NAME

    def merged(model, root):
        return lora_cache.merge(model, [adapter], cache_root=root, progress=False)

    def expected(model):  # the same weights summed in place, in heap copies
        for module in model.modules():
            for attr, param in module._parameters.items():
                module._parameters[attr] = torch.nn.Parameter(param.detach().clone(), requires_grad=False)
        lora_cache.merge(model, [adapter], enabled=False, progress=False)
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    model, adapter = _setup(tmp_path)
    base = tmp_path / "base.safetensors"
    want_clean = expected(_privately_mapped(base, copy.deepcopy(model)))
    want_changed = expected(_fuse_in_place(_privately_mapped(base, copy.deepcopy(model))))
    for first_changed in (False, True):
        root = tmp_path / f"cache-{first_changed}"
        clean = _privately_mapped(base, copy.deepcopy(model))
        changed = _fuse_in_place(_privately_mapped(base, copy.deepcopy(model)))
        for model_, is_changed in ((changed, True), (clean, False))[:: 1 if first_changed else -1]:
            if is_changed:
                with pytest.warns(UserWarning, match=r"1 weight\(s\) \(blocks\.0\.attn\.to_q\.weight\) differ "
                                  r"from the checkpoint file .*summed in place") as caught:
                    stats = merged(model_, root)
                assert stats.cache_key is None and stats.in_place == 6 and "differ" in stats.cache_off
                assert len([w for w in caught if "differ" in str(w.message)]) == 1
            else:
                stats = merged(model_, root)
                assert (stats.built, stats.hit) == (6, 0)  # never the changed model's merge
            want = want_changed if is_changed else want_clean
            assert all(torch.equal(p, want[n]) for n, p in model_.named_parameters())
        built = [e for e in os.listdir(root / "lora_merge_cache") if e != MEMO_NAME and len(e) >= 32
                 and (root / "lora_merge_cache" / e).is_dir()]
        assert len(built) == 1  # the clean start's, and nothing else


def test_a_neighbours_write_copies_a_shared_page_and_the_weight_beside_it_stays_the_files(tmp_path):
    """Two tensors share the page where one ends and the next begins: a write to the first
    copies it, and the second, whose bytes in it are unchanged, is still its file's."""
    from safetensors.torch import load_file

    from lora_cache.key.base_shards import changed_in_memory
    from lora_cache.targets.layer_target import LayerTarget

    path = write_safetensors(tmp_path / "two.safetensors", {"a.weight": torch.randn(1000),
                                                           "b.weight": torch.randn(3000)})
    mapped = load_file(str(path))
    owners = {n: torch.nn.Module() for n in "ab"}
    for n, owner in owners.items():
        owner._parameters["weight"] = torch.nn.Parameter(mapped[f"{n}.weight"], requires_grad=False)
    targets = [LayerTarget(f"{n}.weight", owners[n], "weight") for n in "ab"]
    assert changed_in_memory(targets, AddressSpace()) == []
    owners["a"].weight.data[-1] += 1.0  # copies a's last page, the one b starts in
    space = AddressSpace()
    assert space.private_copies(owners["b"].weight) == 1
    assert changed_in_memory(targets, space) == ["a.weight"]
    owners["a"].weight.data[-1] -= 1.0  # the same bytes again, though the page stays a copy
    assert changed_in_memory(targets, AddressSpace()) == []


@pytest.mark.parametrize("base_files", [False, True], ids=["mapped", "base-files-named"])
def test_a_checkpoint_replaced_after_loading_is_never_the_key_of_the_weights_loaded_before(tmp_path, base_files):
    """The weights are views of the file mapped at load; a new checkpoint renamed over its
    path meanwhile (as downloaders and rsync land one) would key their merge by the new
    file, served to every later start on it. Merged in place, with one warning; a start on
    the new checkpoint builds its own."""
    from hostmem.safetensors.mapping import load_readonly

    model, adapter = _setup(tmp_path)
    base = tmp_path / "base.safetensors"
    heap = copy.deepcopy(model)  # the weights as loaded, summed in place: what the merge must give
    lora_cache.merge(heap, [adapter], enabled=False, progress=False)
    expected = {n: p.detach().clone() for n, p in heap.named_parameters()}
    newer = {k: v + 1 for k, v in load_readonly(os.fspath(base)).items()}
    write_safetensors(tmp_path / "landing.safetensors", newer)
    os.rename(tmp_path / "landing.safetensors", base)
    root = tmp_path / "cache"
    with pytest.warns(UserWarning, match=r"6 weight\(s\) .* are views of a checkpoint file removed or replaced"):
        stats = lora_cache.merge(model, [adapter], cache_root=root, progress=False,
                                 base_files=[os.fspath(base)] if base_files else None)
    assert stats.cache_key is None and stats.in_place == 6
    assert all(torch.equal(p, expected[n]) for n, p in model.named_parameters())
    fresh = copy.deepcopy(model)
    for name, tensor in load_readonly(os.fspath(base)).items():
        owner, _, attr = name.rpartition(".")
        fresh.get_submodule(owner)._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
    assert lora_cache.merge(fresh, [adapter], cache_root=root, progress=False).built == 6


def test_unmerge_after_the_model_was_cast_gives_the_base_as_the_model_now_has_it(tmp_path):
    """Merged in fp32, cast to bf16 with ``model.to``, unmerged: every weight comes back in
    bf16 (the base cast, as ``model.to`` casts an unmerged model), never an fp32 weight
    beside bf16 ones that the next forward refuses."""
    model, adapter = _setup(tmp_path, dtype=torch.float32)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    lora_cache.merge(model, [adapter], cache_root=tmp_path / "cache", progress=False)
    model.to(torch.bfloat16)
    assert lora_cache.unmerge(model) == 6
    for name, weight in model.named_parameters():
        assert weight.dtype == torch.bfloat16 and torch.equal(weight, base[name].to(torch.bfloat16)), name


def test_weights_held_in_memory_that_are_not_the_named_files_are_merged_in_place(tmp_path):
    """A model loaded copied (a heap model, ``from_pretrained`` with a cast) is keyed by the
    shard ``base_files`` names: one loaded from another checkpoint, or with a LoRA fused in
    place, would be served that shard's merge. Each is merged in place with one warning; a
    copy of the named checkpoint, cast as a loader casts it, hits what a clean start built."""
    model, adapter = _setup(tmp_path, dtype=torch.float32)
    base = os.fspath(tmp_path / "base.safetensors")

    def copied(dtype, change=None):
        held = copy.deepcopy(model)
        for module in held.modules():
            for attr, param in module._parameters.items():
                module._parameters[attr] = torch.nn.Parameter(param.detach().to(dtype, copy=True), requires_grad=False)
        if change is not None:
            change(held)
        return held

    def summed_in_place(held):
        lora_cache.merge(held, [adapter], enabled=False, progress=False)
        return {n: p.detach().clone() for n, p in held.named_parameters()}

    root = tmp_path / "cache"
    clean = lora_cache.merge(copied(torch.bfloat16), [adapter], cache_root=root, base_files=[base], progress=False)
    assert clean.built == 6
    assert lora_cache.merge(copied(torch.bfloat16), [adapter], cache_root=root, base_files=[base],
                            progress=False).hit == 6
    other = lambda held: [p.data.mul_(1.5) for p in held.parameters()]  # another checkpoint, same names  # noqa: E731

    def other_transposed(held):  # another checkpoint, each weight stored column-major (the same values)
        for module in held.modules():
            for attr, param in module._parameters.items():
                scaled = param.detach() * 1.5
                stored = scaled.t().contiguous().t() if scaled.dim() == 2 else scaled.contiguous(
                    memory_format=torch.channels_last) if scaled.dim() == 4 else scaled
                module._parameters[attr] = torch.nn.Parameter(stored, requires_grad=False)

    for change, count in ((other, 6), (other_transposed, 6), (_fuse_in_place, 1)):
        held = copied(torch.bfloat16, change)
        want = summed_in_place(copied(torch.bfloat16, change))
        with pytest.warns(UserWarning, match=rf"{count} weight\(s\) .* differ from their tensors in base_files"):
            stats = lora_cache.merge(held, [adapter], cache_root=root, base_files=[base], progress=False)
        assert stats.cache_key is None and stats.in_place == 6
        assert all(torch.equal(p, want[n]) for n, p in held.named_parameters())


def test_a_one_dimensional_weight_is_compared_whole_with_its_file(tmp_path):
    """A bias or norm held in memory of its own that differs from its file everywhere but
    in its middle element is told apart (one "row" of a 1-D weight would be that element)."""
    from lora_cache.key.base_shards import differ_from_files
    from lora_cache.targets.layer_target import LayerTarget

    bias = torch.randn(3072)
    path = write_safetensors(tmp_path / "bias.safetensors", {"proj.bias": bias})
    owner = torch.nn.Module()
    changed = bias + 1.0
    changed[1536] = bias[1536]
    owner._parameters["bias"] = torch.nn.Parameter(changed, requires_grad=False)
    target = LayerTarget("proj.bias", owner, "bias")
    assert differ_from_files([target], AddressSpace(), [os.fspath(path)]) == ["proj.bias"]
    owner._parameters["bias"] = torch.nn.Parameter(bias.clone(), requires_grad=False)
    assert differ_from_files([LayerTarget("proj.bias", owner, "bias")], AddressSpace(), [os.fspath(path)]) == []
