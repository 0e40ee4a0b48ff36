"""Adapter content that would break a merge, or poison it silently, is refused with the key named."""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from lora_cache import Adapter, AdapterError, read_adapter
from lora_cache.adapters import as_adapter, forget_checked
from tests.conftest import write_safetensors


def _pair(up, down, alpha=None, stem="diffusion_model.blocks.0.attn.to_q") -> dict:
    tensors = {f"{stem}.lora_up.weight": up, f"{stem}.lora_down.weight": down}
    if alpha is not None:
        tensors[f"{stem}.alpha"] = alpha
    return tensors


@pytest.mark.parametrize("tensors, message", [
    (_pair(torch.ones(8, 2), torch.ones(2, 8), alpha=torch.ones(0)),
     r"'diffusion_model.blocks.0.attn.to_q.alpha' has 0 values \(shape \(0,\)\); an alpha is one number"),
    (_pair(torch.ones(8, 0), torch.ones(0, 8)), r"'diffusion_model.blocks.0.attn.to_q.lora_down.weight' has rank 0"),
    (_pair(torch.ones(8, 2, 1, 1, 1, 3), torch.ones(2, 8)),
     r"'diffusion_model.blocks.0.attn.to_q.lora_up.weight' is 6-D \(8, 2, 1, 1, 1, 3\); a LoRA up matrix is 2-D"),
    (_pair(torch.ones(8, 2, dtype=torch.int32), torch.ones(2, 8)),
     r"'diffusion_model.blocks.0.attn.to_q.lora_up.weight' is torch.int32; LoRA matrices are floating point"),
])
def test_malformed_parts_are_adapter_errors_naming_file_and_key(tmp_path, tensors, message):
    path = write_safetensors(tmp_path / "bad.safetensors", tensors)
    with pytest.raises(AdapterError, match=rf"bad.safetensors: {message}"):
        read_adapter(path)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_values_are_refused_by_default(tmp_path, value):
    forget_checked()
    down = torch.ones(2, 8)
    down[1, 3] = value
    path = write_safetensors(tmp_path / "nan.safetensors", _pair(torch.ones(8, 2), down))
    with pytest.raises(AdapterError, match=r"nan.safetensors: 'diffusion_model.blocks.0.attn.to_q.lora_down.weight' "
                                           r"holds 1 NaN or infinite value\(s\) of 16"):
        read_adapter(path)
    assert read_adapter(path, check_values=False).modules  # asked for: read as it is


def test_the_finite_check_is_remembered_per_file_identity(tmp_path):
    """A second read of an unchanged file does not scan it again; a rewritten file is scanned."""
    forget_checked()
    path = write_safetensors(tmp_path / "a.safetensors", _pair(torch.ones(8, 2), torch.ones(2, 8)))
    read_adapter(path)
    from lora_cache.adapters import checks

    assert len(checks._CHECKED) == 1
    read_adapter(path)
    assert len(checks._CHECKED) == 1
    bad = torch.ones(2, 8)
    bad[0, 0] = math.nan
    write_safetensors(tmp_path / "b.safetensors", _pair(torch.ones(8, 2), bad))
    os.replace(tmp_path / "b.safetensors", path)  # a new inode: a new identity
    with pytest.raises(AdapterError, match="NaN"):
        read_adapter(path)


@pytest.mark.parametrize("spec, message", [
    ({"path": "a.safetensors", "strength": math.nan}, "strength is nan"),
    ({"path": "a.safetensors", "strength": "strong"}, "strength 'strong' is str, not a number"),
    ({"path": "a.safetensors", "strength": "1.0"}, "strength '1.0' is str, not a number"),
    ({"path": "a.safetensors", "strength": True}, "strength True is bool, not a number"),
    ({"path": "a.safetensors", "alpha": "4"}, "alpha '4' is str, not a number"),
    ({"path": "a.safetensors", "alpha": math.inf}, "alpha is inf"),
    ({"path": "a.safetensors", "convert": "magic"}, "convert 'magic'"),
])
def test_non_finite_strength_or_alpha_in_an_adapter_entry(spec, message):
    with pytest.raises(AdapterError, match=rf"adapter a.safetensors: {message}"):
        as_adapter(spec)
    with pytest.raises(AdapterError, match="strength is nan"):
        Adapter("a.safetensors", strength=float("nan"))


def test_a_scale_beyond_float32_is_refused_before_any_layer_is_merged(tmp_path):
    """strength x alpha / rank beyond float32 (each within it) cannot be summed: refused, naming
    the adapter's key, where it crashed with a conversion overflow inside the merge."""
    import lora_cache
    from lora_cache.placement.layers import checkpoint_module

    base = tmp_path / "base.safetensors"
    write_safetensors(base, {"blocks.0.attn.to_q.weight": torch.ones(8, 8)})
    write_safetensors(tmp_path / "a.safetensors", _pair(torch.ones(8, 2), torch.ones(2, 8)))
    huge = Adapter(os.fspath(tmp_path / "a.safetensors"), strength=1e30, alpha=1e30)  # each alone is fine
    with pytest.raises(AdapterError, match=r"lora_up.weight': its scale 5e\+59 .*beyond float32's range"):
        lora_cache.merge(checkpoint_module([os.fspath(base)]), [huge], cache_root=os.fspath(tmp_path / "cache"),
                         progress=False)
    with pytest.raises(AdapterError, match="strength 1e\\+300 is beyond float32's range"):
        Adapter("a.safetensors", strength=1e300)


# ----------------------------------------------------------------- random files

_PREFIXES = ["diffusion_model.", "transformer.", "base_model.model.", "lora_unet_"]
_FLOATS = [torch.float32, torch.float16, torch.bfloat16]


@st.composite
def _tensor(draw, shape):
    """Mostly well-formed: a float tensor of ``shape``; sometimes another dtype or a NaN/Inf."""
    dtype = draw(st.sampled_from(_FLOATS + _FLOATS + [torch.int64]))
    if not dtype.is_floating_point:
        return torch.zeros(shape, dtype=dtype)
    tensor = torch.full(shape, draw(st.sampled_from([0.5, -2.0, 1.0])), dtype=dtype)
    if tensor.numel() and draw(st.integers(0, 5)) == 0:
        tensor.view(-1)[0] = draw(st.sampled_from([math.nan, math.inf]))
    return tensor


@st.composite
def _module(draw, stem):
    """One module's parts: a LoRA pair (ranks that agree or not, 2-D to 4-D) or full diffs, an alpha."""
    out, inp, rank = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(0, 3))
    up_rank = draw(st.sampled_from([rank, rank, rank, rank + 1]))
    extra = draw(st.sampled_from([(), (), (), (1,), (1, 1), (2, 2)]))
    names = [("lora_up.weight", "lora_down.weight"), ("lora_B.weight", "lora_A.weight")]
    up_key, down_key = draw(st.sampled_from(names))
    parts = {}
    if draw(st.booleans()):
        parts[up_key] = draw(_tensor((out, up_rank, *extra)))
        if draw(st.integers(0, 7)):  # now and then a truncated pair
            parts[down_key] = draw(_tensor((rank, inp, *extra)))
    else:
        parts["diff"] = draw(_tensor((out, inp)))
        if draw(st.booleans()):
            parts["diff_b"] = draw(_tensor((out,)))
    alpha_shape = draw(st.sampled_from([None, (), (), (1,), (0,), (2,)]))
    if alpha_shape is not None:
        parts["alpha"] = draw(_tensor(alpha_shape))
    if draw(st.integers(0, 9)) == 0:
        parts[draw(st.sampled_from(["scale", "weight", "on_input"]))] = torch.ones(2)
    return {f"{stem}.{suffix}": tensor for suffix, tensor in parts.items()}


@st.composite
def _adapter_tensors(draw):
    prefix = draw(st.sampled_from(_PREFIXES))
    modules = st.sampled_from(["a", "b.c", "blocks.0.q", "blocks.1.k"])
    names = draw(st.lists(modules, min_size=1, max_size=4, unique=True))
    tensors = {}
    for name in names:
        stem = prefix + (name.replace(".", "_") if prefix == "lora_unet_" else name)
        tensors.update(draw(_module(stem)))
    return tensors


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tensors=_adapter_tensors(), ss_alpha=st.sampled_from([None, "4", "nan", "x"]))
def test_any_file_is_a_good_read_or_an_adapter_error(tmp_path, tensors, ss_alpha):
    """Random keys, shapes, dtypes, alphas: every outcome is a usable read or an AdapterError."""
    from hostmem.safetensors.mapping import save_file
    from lora_cache.compute.merge_math import UnsupportedAdapterError

    forget_checked()
    with tempfile.TemporaryDirectory(dir=tmp_path) as folder:
        path = os.path.join(folder, "r.safetensors")
        save_file(tensors, path, metadata=None if ss_alpha is None else {"ss_network_alpha": ss_alpha})
        try:
            read = read_adapter(path)
        except UnsupportedAdapterError:
            assert any(k.endswith("on_input") for k in tensors)
            event("unsupported variant")
            return
        except AdapterError as exc:
            assert path in str(exc)
            event("adapter error")
            return
        event("good read")
        for change in read.modules.values():
            rank = read.rank(change)
            alpha = read.alpha(change)
            assert alpha is None or math.isfinite(alpha)
            assert rank is None or rank > 0
            for tensor in change.parts.values():
                assert bool(torch.isfinite(tensor.float()).all())
