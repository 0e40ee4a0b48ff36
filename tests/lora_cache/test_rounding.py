"""Rounding loss: a sub-ulp (Turbo-style) LoRA is measured, said, and kept at run time."""

from __future__ import annotations

import os
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import lora_cache
from hostmem.safetensors.mapping import load_readonly
from lora_cache.orchestrate import plan_targets
from planners.cli import main
from planners.report import _lora_merge_lines
from lora_cache.placement.rounding import THRESHOLD, OverflowingUpdateError, RoundingLossError, lost_share
from tests.conftest import write_safetensors
from tests.lora_cache.test_adapters import write_adapter

DIM = 1024
STEP = 2.0**-12  # one bf16 step of every weight below: magnitudes in [2**-5, 2**-4)
BF16_EPS = 2.0**-7  # bf16's machine epsilon: the tolerance of a bf16 output against fp32


def _weight(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    magnitude = 0.0315 + torch.rand(DIM, DIM, generator=gen) * 0.03
    sign = torch.randint(0, 2, (DIM, DIM), generator=gen) * 2 - 1
    return (magnitude * sign).bfloat16()


def base_model(folder) -> nn.ModuleDict:
    """Two bf16 Linears whose weights are read-only mapped views of a file written here."""
    path = write_safetensors(os.path.join(folder, "base.safetensors"),
                             {"turbo.weight": _weight(1), "plain.weight": _weight(2)})
    model = nn.ModuleDict({"turbo": nn.Linear(DIM, DIM, bias=False), "plain": nn.Linear(DIM, DIM, bias=False)})
    for name, tensor in load_readonly(path).items():
        owner, _, attr = name.rpartition(".")
        model[owner]._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
    return model


def adapter(folder, ulps: float = 0.1) -> tuple[str, dict]:
    """``turbo``: a rank-1 update spread as a LoRA's is, its elements' standard deviation
    ``ulps`` bf16 steps of the weights, coherent along each row (as a distilled LoRA's
    is, so the outputs change by many of their steps); ``plain``: an ordinary rank-4
    LoRA, many steps large."""
    gen = torch.Generator().manual_seed(3)
    size = (ulps * STEP) ** 0.5
    down = (0.5 + torch.rand(1, DIM, generator=gen)) / (13 / 12) ** 0.5  # mean square 1, every one positive
    changes = {
        "turbo": {"up": (torch.randn(DIM, 1, generator=gen) * size).bfloat16(), "down": (down * size).bfloat16()},
        "plain": {"up": (torch.randn(DIM, 4, generator=gen) * 0.1).bfloat16(),
                  "down": (torch.randn(4, DIM, generator=gen) / DIM**0.5).bfloat16()},
    }
    return write_adapter(os.path.join(folder, "turbo.safetensors"), "comfyui", changes), changes


def fp32_reference(weight: torch.Tensor, change: dict, x: torch.Tensor) -> torch.Tensor:
    """The layer's output with the update added in fp32 and nothing rounded."""
    merged = weight.float() + change["up"].float() @ change["down"].float()
    return x.float() @ merged.T


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return float((out.float() - reference).norm() / reference.norm())


def test_sub_ulp_lora_is_reported_and_served_at_run_time(tmp_path):
    model = base_model(tmp_path)
    base = model.turbo.weight.detach().clone()
    path, changes = adapter(tmp_path)
    x = torch.ones(8, DIM, dtype=torch.bfloat16)
    reference = fp32_reference(base, changes["turbo"], x)
    said = r"1 layer\(s\) lose \(or gain\) over 5% .*turbo\.weight 100% lost.*kept at run time"
    with pytest.warns(UserWarning, match=said):
        stats = lora_cache.merge(model, [path], cache_root=tmp_path / "cache")
    assert stats.rounding["lost"]["turbo.weight"] > 0.95 and "plain.weight" not in stats.rounding["lost"]
    assert (stats.at_runtime, stats.built, stats.layers) == (1, 1, 2)
    assert "rounding: 1 layer(s) lose (or gain) over 5%" in str(stats)
    assert model.turbo.weight.data_ptr() == load_readonly(tmp_path / "base.safetensors")["turbo.weight"].data_ptr() \
        or torch.equal(model.turbo.weight, base)  # the base itself, never written
    served = model.turbo(x)
    assert relative_error(served, reference) < BF16_EPS
    merged_anyway = x @ (base.float() + changes["turbo"]["up"].float() @ changes["turbo"]["down"].float()).bfloat16().T
    assert relative_error(merged_anyway, reference) > 2 * BF16_EPS  # what merging would have served
    report = "\n".join(_lora_merge_lines(SimpleNamespace(lora_merge=stats.to_dict())))
    assert "rounding to the weights' dtype loses over 5% of 1 weight tensor(s)' update (turbo.weight 100%): 1 at run time" \
        in report  # the startup report's line
    lora_cache.unmerge(model)
    assert torch.equal(model.turbo(x), x @ base.T)  # unmerge takes the run-time terms off too


def test_next_start_hits_the_merged_layers_and_keeps_the_lossy_one_at_run_time(tmp_path):
    path, changes = adapter(tmp_path)
    with pytest.warns(UserWarning, match="lose \\(or gain\\) over"):
        lora_cache.merge(base_model(tmp_path), [path], cache_root=tmp_path / "cache")
    model = base_model(tmp_path)
    with pytest.warns(UserWarning, match="lose \\(or gain\\) over"):
        stats = lora_cache.merge(model, [path], cache_root=tmp_path / "cache")
    assert (stats.hit, stats.built, stats.at_runtime, stats.bytes_written) == (1, 0, 1, 0)


def test_merge_policy_merges_anyway_and_says_so(tmp_path):
    model = base_model(tmp_path)
    path, _ = adapter(tmp_path)
    with pytest.warns(UserWarning, match=r"1 merged anyway \(rounding='merge'\)"):
        stats = lora_cache.merge(model, [path], cache_root=tmp_path / "cache", rounding="merge")
    assert stats.at_runtime == 0 and stats.built == 2
    assert stats.rounding["merged_anyway"] == {"turbo.weight": "rounding='merge'"}


def test_refuse_policy_refuses_before_any_weight_changes(tmp_path):
    model = base_model(tmp_path)
    path, _ = adapter(tmp_path)
    with pytest.raises(RoundingLossError, match=r"refused .*turbo\.weight 100% lost.*rounding='runtime'"):
        lora_cache.merge(model, [path], cache_root=tmp_path / "cache", rounding="refuse")
    assert not lora_cache.is_merged(model)
    with pytest.raises(ValueError, match="rounding policy 'sometimes' is not one of runtime, merge, refuse"):
        lora_cache.merge(model, [path], cache_root=tmp_path / "cache", rounding="sometimes")


@pytest.mark.parametrize("ulps, lost", [(0.1, (0.95, 1.0)), (1.0, (-0.02, 0.02)), (4.0, (-0.02, 0.02))])
def test_share_lost_by_update_size(tmp_path, ulps, lost):
    """The threshold's grounds: an update of an ulp or more keeps about all of it, one
    below half an ulp none; the plain LoRA beside it loses nothing."""
    model = base_model(tmp_path)
    path, _ = adapter(tmp_path, ulps)
    targets = {t.name: t for t in plan_targets(model, [path])[0]}
    assert lost[0] <= lost_share(targets["turbo.weight"]) <= lost[1]
    assert abs(lost_share(targets["plain.weight"])) < THRESHOLD / 5


def test_an_ordinary_lora_says_nothing(tmp_path):
    model = base_model(tmp_path)
    path, _ = adapter(tmp_path, ulps=4.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats = lora_cache.merge(model, [path], cache_root=tmp_path / "cache")
    assert stats.at_runtime == 0 and stats.rounding["lost"] == {} and stats.rounding["measured"] == 2


def test_set_adapters_keeps_the_lossy_layer_at_run_time_and_shares_merges_combination(tmp_path):
    path, changes = adapter(tmp_path)
    with pytest.warns(UserWarning, match="lose \\(or gain\\) over"):
        built = lora_cache.merge(base_model(tmp_path), [path], cache_root=tmp_path / "cache")
    model = base_model(tmp_path)
    base = model.turbo.weight.detach().clone()
    x = torch.ones(8, DIM, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="turbo\\.weight (9\\d|100)% lost.*kept at run time"):
        switched = lora_cache.set_adapters(model, [path], tmp_path / "cache")
    assert (switched.mode, switched.layers) == ("cached", 2)
    assert relative_error(model.turbo(x), fp32_reference(base, changes["turbo"], x)) < BF16_EPS
    os.makedirs(tmp_path / "fresh")
    fresh = base_model(tmp_path / "fresh")  # another server, building its own cache in the background
    with pytest.warns(UserWarning, match="kept at run time"):
        building = lora_cache.set_adapters(fresh, [path], tmp_path / "other", background=True)
    assert building.mode == "runtime"
    assert lora_cache.swap_ready(fresh, wait=True, timeout=60)
    assert relative_error(fresh.turbo(x), fp32_reference(base, changes["turbo"], x)) < BF16_EPS
    assert torch.equal(fresh.plain.weight, model.plain.weight) and built.at_runtime == 1
    lora_cache.set_adapters(fresh, [], tmp_path / "other")
    assert torch.equal(fresh.turbo(x), x @ base.T)  # back to the base: the run-time terms are off


def write_config(folder, path, root) -> str:
    """A deployment of the base under ``folder`` with the adapter ``path``, cached in ``root``."""
    config = os.path.join(folder, "deploy.yaml")
    with open(config, "w") as handle:
        handle.write(f"""
deployment: turbo
host: {{limit: 8GiB, reserve: 1GiB}}
workload: {{steps: 4}}
components:
  dit: {{path: {os.path.join(folder, 'base.safetensors')}, offload: layerwise, layers: "blocks.{{i}}."}}
lora:
  adapters: [{{path: {path}, strength: 1.0}}]
  cache: {{root: {root}, enabled: true}}
""")
    return config


def test_hostmem_lora_merge_says_the_loss_and_takes_the_policy(tmp_path, capsys):
    base_model(tmp_path)  # writes base.safetensors
    path, _ = adapter(tmp_path)
    config = write_config(tmp_path, path, tmp_path / "cache")
    assert main(["lora", "merge", str(config)]) == 0
    out, err = capsys.readouterr()
    assert "1 built" in out and "1 at run time" in out  # left unbuilt: the server keeps it at run time
    assert "rounding: 1 layer(s) lose (or gain) over 5%" in out
    assert "Warning" not in err and "lose (or gain)" not in err  # said once, in the report's line
    model = base_model(tmp_path)  # the server's start on the image: the merged layer a hit, the lossy one at run time
    with pytest.warns(UserWarning, match="kept at run time"):
        stats = lora_cache.merge(model, [path], cache_root=tmp_path / "cache")
    assert (stats.hit, stats.built, stats.at_runtime, stats.bytes_written) == (1, 0, 1, 0)
    assert main(["lora", "merge", str(config), "--rounding", "refuse"]) != 0
    err = capsys.readouterr().err
    assert "refused (rounding='refuse')" in err and "Traceback" not in err


@pytest.mark.parametrize("dtype, size", [(torch.bfloat16, 1e19), (torch.float32, 1e19), (torch.float16, 3e2)])
def test_an_update_that_overflows_the_weights_dtype_is_refused_before_anything_is_written(tmp_path, dtype, size):
    """Each value of the file is finite; their product is not (in fp32, or once rounded to
    fp16): merged, the layer would hold inf where the base is finite, and be served."""
    path = write_safetensors(os.path.join(tmp_path, "base.safetensors"), {"plain.weight": _weight(2).to(dtype)})
    model = nn.ModuleDict({"plain": nn.Linear(DIM, DIM, bias=False)})
    model["plain"]._parameters["weight"] = nn.Parameter(load_readonly(path)["plain.weight"], requires_grad=False)
    gen = torch.Generator().manual_seed(4)
    change = {"plain": {"up": (torch.rand(DIM, 4, generator=gen) + 0.5) * size,
                        "down": (torch.rand(4, DIM, generator=gen) + 0.5) * size}}
    adapter_path = write_adapter(os.path.join(tmp_path, "huge.safetensors"), "comfyui", change)
    with pytest.raises(OverflowingUpdateError, match=r"huge\.safetensors.*plain\.weight gives inf or NaN"):
        lora_cache.merge(model, [adapter_path], cache_root=tmp_path / "cache", rounding="merge", progress=False)
    assert not lora_cache.is_merged(model)
    assert torch.isfinite(model["plain"].weight).all()
    cache = tmp_path / "cache" / "lora_merge_cache"
    assert not [e for e in (os.listdir(cache) if cache.is_dir() else []) if len(e) >= 32 and (cache / e).is_dir()]


def test_the_check_reads_only_the_sampled_rows_of_a_cold_base(tmp_path):
    """Measured row by row, each sampled row of a cold mapped base is a fault the kernel
    reads around (the whole 2 MiB layer, in the end); the check asks for its rows' pages
    first, so the disk reads those and no more."""
    from lora_cache.placement.rounding import SAMPLE_ROWS, measure
    from tests.page_cache import cached_pages

    model, (path_adapter, _) = base_model(tmp_path), adapter(tmp_path)
    base = os.path.join(tmp_path, "base.safetensors")
    fd = os.open(base, os.O_RDONLY)
    try:
        os.fsync(fd)  # written just now: dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if sum(cached_pages(base)) > 4:
        pytest.skip("the page cache kept the base (a file system that cannot drop it)")
    targets, _ = plan_targets(model, [lora_cache.Adapter(path_adapter)])
    lost, measured, _ = measure(targets)
    assert measured == 2 and set(lost) == {"turbo.weight"}
    read, sampled = sum(cached_pages(base)), 2 * SAMPLE_ROWS  # a 2 KiB row lies in one page
    assert read <= 2 * sampled, f"{read} pages read for {sampled} sampled rows"
