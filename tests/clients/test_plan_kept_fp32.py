"""The plan holds a weight the model class keeps in fp32 at the size the loader holds it.

``components.NAME.dtype`` makes the plan count each cast weight as a copy at the served
size; the loader keeps some modules in fp32 (diffusers' ``_keep_in_fp32_modules`` under
any ``torch_dtype``, transformers' under fp16 only: T5's ``wo``, a third of its
encoder). The plan's weight bytes equal what ``from_pretrained`` really holds, and its
copies what that load had to make, the load differential against the real clients."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("diffusers", reason="the served model needs diffusers (pip install hostmem[test])")
transformers = pytest.importorskip("transformers", reason="the text encoder needs transformers (pip install hostmem[test])")

from planners.cli import main as cli  # noqa: E402
from tests.clients import tiny_models as tm  # noqa: E402


def _held(model: torch.nn.Module, stored: dict[str, torch.dtype]) -> tuple[int, int]:
    """(bytes the loaded model holds in its state, bytes of those held in another dtype than stored)."""
    total, copied, seen = 0, 0, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen or name not in stored:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.nbytes
        copied += tensor.nbytes if tensor.dtype != stored[name] else 0
    return total, copied


def _planned(tmp_path, capsys, path, dtype: str, layers: str, offload: str = "layerwise") -> dict:
    config = tmp_path / "deploy.yaml"
    config.write_text(json.dumps({"deployment": "kept", "host": {"limit": "8GiB", "reserve": "1GiB"},
                                  "workload": {"steps": 4},
                                  "components": {"m": {"path": str(path), "offload": offload, "layers": layers,
                                                       "dtype": dtype}}}))
    capsys.readouterr()
    assert cli(["plan", str(config), "--json"]) in (0, 1)
    return json.loads(capsys.readouterr().out)["components"]["m"]


def _stored(path) -> dict[str, torch.dtype]:
    from safetensors import safe_open

    import glob

    out = {}
    for file in glob.glob(f"{path}/*.safetensors"):
        with safe_open(file, "pt") as handle:
            for name in handle.keys():
                out[name] = handle.get_slice(name).get_dtype()
    names = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    return {n: names[d] for n, d in out.items()}


@pytest.mark.parametrize("stored, served", [(torch.bfloat16, "fp16"), (torch.float32, "bf16")])
def test_a_wan_transformers_fp32_modules_are_planned_as_the_loader_holds_them(tmp_path, capsys, stored, served):
    path = tm.save_model("wan", tmp_path / "wan", stored)
    loaded = tm.load_model("wan", path, {"fp16": torch.float16, "bf16": torch.bfloat16}[served])
    assert loaded.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32
    held, copied = _held(loaded, _stored(path))
    planned = _planned(tmp_path, capsys, path, served, "blocks.{i}.")
    assert (planned["weights_bytes"], planned["anonymous"]) == (held, copied)


@pytest.mark.parametrize("served", ["fp16", "bf16"])
def test_a_t5_encoders_wo_is_planned_in_fp32_under_fp16_only(tmp_path, capsys, served):
    config = transformers.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=256, num_layers=2, num_heads=4)
    torch.manual_seed(0)
    transformers.T5EncoderModel(config).to(torch.bfloat16).save_pretrained(tmp_path / "te")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[served]
    loaded = transformers.T5EncoderModel.from_pretrained(tmp_path / "te", dtype=dtype)
    wo = loaded.encoder.block[0].layer[1].DenseReluDense.wo.weight
    assert wo.dtype == (torch.float32 if served == "fp16" else torch.bfloat16)
    held, copied = _held(loaded, _stored(tmp_path / "te"))
    planned = _planned(tmp_path, capsys, tmp_path / "te", served, "encoder.block.{i}.", offload="none")
    assert (planned["weights_bytes"], planned["anonymous"]) == (held, copied)
    assert copied > 0 if served == "fp16" else copied == 0
