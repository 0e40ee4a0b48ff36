"""hostmem.remap(spill=True) on diffusers transformers whose weights were cast at load.

A cast leaves weights no checkpoint holds: remap alone must leave them anonymous. The
spill writes them once into the cache and maps them back, so the ledger shows (almost)
nothing anonymous, the forward pass is bit for bit the one before, a later start writes
nothing, a damaged layer file is rebuilt and named, and a read-only root serves as the
vault's read-only roots do.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import hostmem
from hostmem.slots import MappedAreas
from hostmem.vault.layer_file import layer_file_name
from tests.conftest import run_python
from tests.faults.world import flip_byte

diffusers = pytest.importorskip("diffusers", reason="the spill client tests load real diffusers models")

from tests.clients.test_remap_diffusers import MODELS, _forward  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# How each model is cast at load: (kind, checkpoint dtype, torch_dtype of from_pretrained).
CASES = {
    "flux-fp32-as-bf16": ("flux", torch.float32, torch.bfloat16),  # every weight cast
    "wan-keep-in-fp32": ("wan", torch.bfloat16, torch.bfloat16),  # _keep_in_fp32_modules kept fp32 over bf16
}


def save(tmp_path, case: str) -> str:
    kind, dtype, _ = CASES[case]
    torch.manual_seed(0)
    model, _ = MODELS[kind]()
    folder = os.path.join(tmp_path, case)
    model.to(dtype).save_pretrained(folder)
    return folder


def load(folder: str, case: str):
    kind, _, dtype = CASES[case]
    return type(MODELS[kind]()[0]).from_pretrained(folder, torch_dtype=dtype).eval()


def forward(model, case: str) -> torch.Tensor:
    kind, _, dtype = CASES[case]
    inputs = MODELS[kind]()[1]
    return _forward(model, {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()})


def start(folder: str, case: str, cache_root):
    """One start: load (with its cast), remap with spill; the model, the report, and whether
    the forward output kept every bit."""
    model = load(folder, case)
    before = forward(model, case)
    report = hostmem.remap(model, spill=True, cache_root=cache_root)
    return model, report, torch.equal(forward(model, case), before)


def _cast_bytes(folder: str, case: str) -> int:
    """What remap alone leaves as cast (and anonymous) on this load."""
    report = hostmem.remap(load(folder, case))
    assert report.left_bytes["changed"] == 0
    return report.left_bytes["cast"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_cast_weights_are_spilled_mapped_back_and_compute_the_same_bits(tmp_path, case):
    folder = save(tmp_path, case)
    cast = _cast_bytes(folder, case)
    assert cast > 0
    model = load(folder, case)
    assert hostmem.account(model).totals.anonymous >= cast
    before = forward(model, case)

    report = hostmem.remap(model, spill=True, cache_root=tmp_path / "cache")

    totals = hostmem.account(model).totals
    assert totals.anonymous <= 0.01 * (totals.anonymous + totals.file_backed + totals.not_resident), totals
    assert report.spilled_bytes == cast and report.left_bytes["cast"] == 0
    assert report.spill_written_bytes >= cast and report.spill_reused_bytes == 0 and report.spill_problem is None
    text = str(report)
    assert "remapped" in text and "spilled" in text and "left" in text, text
    files = {MappedAreas().read_only_file(p) for p in model.parameters()}
    spilled = {f for f in files if f and f.startswith(os.path.join(tmp_path, "cache", ""))}
    assert spilled and files - spilled <= {os.path.join(folder, "diffusion_pytorch_model.safetensors")}, files
    assert torch.equal(forward(model, case), before)


SECOND_START = """
import json, sys
from tests.clients.test_remap_spill import start
model, report, equal = start(sys.argv[1], sys.argv[2], sys.argv[3])
print(json.dumps({"report": report.to_dict(), "equal": equal}))
"""


def test_a_second_process_with_the_same_weights_writes_nothing(tmp_path):
    case = "wan-keep-in-fp32"
    folder, root = save(tmp_path, case), str(tmp_path / "cache")
    _, first, _ = start(folder, case, root)
    assert first.spill_written_bytes > 0

    done = run_python(SECOND_START, folder, case, root, cwd=REPO)

    assert done.returncode == 0, done.stderr
    second = json.loads(done.stdout.strip().splitlines()[-1])
    assert second["equal"]
    report = second["report"]
    assert report["spill_written_bytes"] == 0 and report["spill_reused_bytes"] == first.spill_written_bytes
    assert (report["spilled"], report["spilled_bytes"]) == (first.spilled, first.spilled_bytes)
    assert report["spill_key"] == first.spill_key and report["left_bytes"]["cast"] == 0
    assert "failed its check" not in done.stderr
    from planners.cli import main

    assert main(["cache", "verify", "--root", root]) == 0  # every layer file read again: its checksum holds


def test_a_damaged_spill_file_is_never_served_but_named_and_rebuilt(tmp_path, capfd):
    case = "flux-fp32-as-bf16"
    folder, root = save(tmp_path, case), tmp_path / "cache"
    model, first, _ = start(folder, case, root)
    expected = forward(model, case)
    name = "transformer_blocks.0.attn.to_q.weight"
    layer = os.path.join(root, "lora_merge_cache", first.spill_key, layer_file_name(name))
    del model
    flip_byte(layer, os.path.getsize(layer) - 3)  # in the weight's bytes: the header still checks out
    capfd.readouterr()

    model, second, equal = start(folder, case, root)

    said = capfd.readouterr().err
    assert name in said and layer_file_name(name) in said and "rebuilding it" in said, said
    assert second.spill_written_bytes == os.path.getsize(layer)  # that layer alone
    assert second.spill_reused_bytes == first.spill_written_bytes - os.path.getsize(layer)
    assert equal and torch.equal(forward(model, case), expected)


def test_a_read_only_root_serves_what_it_holds_and_writes_nothing(tmp_path, read_only_copy):  # noqa: F811
    case = "flux-fp32-as-bf16"
    folder, built = save(tmp_path, case), str(tmp_path / "image-build")
    _, first, _ = start(folder, case, built)
    baked = read_only_copy(built)
    listing = sorted(os.listdir(os.path.join(built, "lora_merge_cache")))

    _, served, equal = start(folder, case, baked)

    assert equal and served.spill_root == baked and served.spill_written_bytes == 0
    assert served.spill_reused_bytes == first.spill_written_bytes and served.left_bytes["cast"] == 0
    assert sorted(os.listdir(os.path.join(built, "lora_merge_cache"))) == listing  # not even a lock file


def test_a_read_only_root_without_the_weights_leaves_them_or_builds_after_it(tmp_path, read_only_copy):  # noqa: F811
    case = "flux-fp32-as-bf16"
    folder = save(tmp_path, case)
    os.mkdir(tmp_path / "empty")
    empty = read_only_copy(str(tmp_path / "empty"))
    with pytest.warns(UserWarning, match=r"not spilled .*read-only.*cache_root=\[") as caught:
        _, alone, equal = start(folder, case, empty)
    assert len([w for w in caught if "not spilled" in str(w.message)]) == 1
    assert equal and alone.spilled == 0 and alone.left_bytes["cast"] > 0 and "read-only" in str(alone)
    assert os.listdir(tmp_path / "empty") == []

    local = str(tmp_path / "local")
    _, built, equal = start(folder, case, [empty, local])
    assert equal and built.spill_root == local and built.spilled_bytes == alone.left_bytes["cast"]
