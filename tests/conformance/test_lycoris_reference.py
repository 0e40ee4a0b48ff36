"""LoHa, LoKr and Tucker LoCon merged by lora_cache against ``lycoris-lora`` itself: each
module made by LyCORIS's own classes (every layout its options give: Tucker cores, halves
stored whole or as pairs, full matrices), saved by its ``custom_state_dict`` under its names,
merged here, and compared with the change its trainer applies (``get_weight`` times the
multiplier, what its forward adds). Skipped where ``lycoris-lora`` is not installed; the
corpus (corpus_lycoris.py) holds the same math written out without it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

lycoris_loha = pytest.importorskip("lycoris.modules.loha", reason="needs lycoris-lora (pip install lycoris-lora)")

import lora_cache  # noqa: E402
from lycoris.modules.locon import LoConModule  # noqa: E402
from lycoris.modules.lokr import LokrModule  # noqa: E402
from tests.conftest import write_safetensors  # noqa: E402

STRENGTH = 0.7
_LOKR = [{}, {"decompose_both": True}, {"full_matrix": True}, {"factor": 4}, {"use_tucker": True}]


def _layer(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(256, 512) if kind == "linear" else nn.Conv2d(64, 128, 3, padding=1)


def _trained(module: nn.Module, seed: int) -> nn.Module:
    """LyCORIS's module with every factor moved off its initial value, as training does."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if not name.startswith("org"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return module


def _merged_change(tmp_path, layer: nn.Module, state: dict) -> torch.Tensor:
    """lora_cache's merge of ``state`` (LyCORIS's names under ``lycoris_layer``) into a copy of ``layer``."""
    path = write_safetensors(tmp_path / "lyco.safetensors",
                             {f"lycoris_layer.{k}": v.detach().float().contiguous() for k, v in state.items()})
    model = nn.ModuleDict({"layer": copy.deepcopy(layer)})
    lora_cache.merge(model, [lora_cache.Adapter(path, STRENGTH)], enabled=False, progress=False, rounding="merge")
    return model["layer"].weight.double() - layer.weight.double()


def _assert_same(ours: torch.Tensor, theirs: torch.Tensor, layer: nn.Module) -> None:
    """Equal up to the one rounding of the merged fp32 weight (an ulp of the weight's largest)."""
    ulp = torch.finfo(torch.float32).eps * float(layer.weight.abs().max() + theirs.abs().max())
    torch.testing.assert_close(ours, theirs.double(), rtol=0, atol=ulp)
    assert float(theirs.abs().max()) > 100 * ulp  # a change the comparison can see


def _trainer_change(module) -> torch.Tensor:
    """What LyCORIS's forward adds at this multiplier (``get_weight`` holds alpha / rank)."""
    with torch.no_grad():
        return module.get_weight(module.shape) * STRENGTH


@pytest.mark.parametrize("kind, tucker", [("linear", False), ("conv", False), ("conv", True)])
def test_loha_as_lycoris_trains_it(tmp_path, kind, tucker):
    layer = _layer(kind)
    module = _trained(lycoris_loha.LohaModule("lycoris_layer", layer, lora_dim=4, alpha=2, use_tucker=tucker), 1)
    _assert_same(_merged_change(tmp_path, layer, module.custom_state_dict()), _trainer_change(module), layer)


@pytest.mark.parametrize("kind", ["linear", "conv"])
@pytest.mark.parametrize("options", _LOKR, ids=lambda o: ",".join(o) or "default")
def test_lokr_as_lycoris_trains_it(tmp_path, kind, options):
    if kind == "linear" and "use_tucker" in options:
        pytest.skip("a Tucker core is a conv's")
    layer = _layer(kind)
    module = _trained(LokrModule("lycoris_layer", layer, lora_dim=2, alpha=3, **options), 2)
    _assert_same(_merged_change(tmp_path, layer, module.custom_state_dict()), _trainer_change(module), layer)


def test_tucker_locon_as_lycoris_trains_it(tmp_path):
    layer = _layer("conv")
    module = _trained(LoConModule("lycoris_layer", layer, lora_dim=4, alpha=2, use_tucker=True), 3)
    state = {k: v for k, v in module.state_dict().items() if k.startswith(("lora_", "alpha"))}
    assert "lora_mid.weight" in state
    with torch.no_grad():  # its forward: the rebuilt up x mid x down, times alpha / rank
        theirs = module.make_weight(torch.device("cpu")) * module.scale * STRENGTH
    _assert_same(_merged_change(tmp_path, layer, state), theirs.reshape(layer.weight.shape), layer)
