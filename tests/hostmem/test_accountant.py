"""The accountant's Ledger over real modules and real mappings."""

import json

import pytest
import torch

from hostmem import account, load_readonly
from tests.conftest import write_safetensors

MiB = 1024 * 1024


def _mapped_linear(path, out_features=512, in_features=1024):
    write_safetensors(path, {"weight": torch.randn(out_features, in_features), "bias": torch.zeros(out_features)})
    tensors = load_readonly(path)
    layer = torch.nn.Linear(in_features, out_features)
    layer.weight = torch.nn.Parameter(tensors["weight"], requires_grad=False)
    layer.bias = torch.nn.Parameter(tensors["bias"], requires_grad=False)
    return layer


def test_components_split_mapped_and_anonymous(tmp_path):
    dit = _mapped_linear(tmp_path / "dit.safetensors")
    for p in dit.parameters():
        float(p.sum())
    text_encoder = torch.nn.Linear(1024, 1024)
    ledger = account({"dit": dit, "text_encoder": text_encoder})
    dit_totals = ledger.components["dit"].totals
    te_totals = ledger.components["text_encoder"].totals
    assert dit_totals.file_backed == (512 * 1024 + 512) * 4
    assert dit_totals.anonymous == 0
    assert te_totals.anonymous == (1024 * 1024 + 1024) * 4
    assert ledger.process.rss_anon >= te_totals.anonymous
    # Memory that no parameter holds shows up as unattributed, and only there.
    stray = torch.empty(32 * MiB, dtype=torch.uint8).fill_(1)
    again = account({"dit": dit, "text_encoder": text_encoder})
    grew = again.unattributed_anonymous - ledger.unattributed_anonymous
    assert 30 * MiB <= grew <= 40 * MiB, grew
    assert again.totals == ledger.totals
    del stray


def test_ledger_serialises_to_json_in_bytes_and_reads_as_a_table(tmp_path):
    dit = _mapped_linear(tmp_path / "dit.safetensors")
    ledger = account(dit)
    data = json.loads(json.dumps(ledger.to_dict()))
    params = data["components"]["model"]["parameters"]
    assert params["weight"]["nbytes"] == 512 * 1024 * 4
    assert params["weight"]["not_resident"] == 512 * 1024 * 4
    assert data["totals"]["non_reclaimable"] == 0
    table = ledger.to_table(top=2)
    assert "model" in table and "weight" in table and "2.0 MiB" in table
    assert "unattributed anonymous" in table


def test_views_of_one_storage_are_counted_once():
    base = torch.randn(1024, 1024)
    module = torch.nn.Module()
    module.register_buffer("whole", base)
    module.register_buffer("top_half", base[:512])
    ledger = account(module)
    params = ledger.components["model"].parameters
    assert list(params) == ["whole"] and params["whole"].shared_with == ("top_half",)
    assert ledger.totals.anonymous == base.nbytes


def test_rejects_what_is_not_a_module():
    with pytest.raises(TypeError, match="dit"):
        account({"dit": torch.zeros(3)})
