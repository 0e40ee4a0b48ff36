"""Warnings that name the real cause: a block family left in (rest), a pin cap of 0, a
missing adapter a declared-size plan does not read; and the executor's roles of a second
streamed component."""

from __future__ import annotations

import json
import os

import pytest
import torch

from planners.cli import main
from planners.plan_build import build_plan
from planners.config import load_config
from planners.layer_roles import plan_roles

from .conftest import MiB, write_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _warnings(capsys, path) -> list[str]:
    assert main(["plan", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["warnings"]


def test_a_dit_whose_pattern_misses_a_block_family_names_that_family(tmp_path, capsys):
    # 4 double blocks of 2 MiB the pattern names, 3 single blocks of 2 MiB it does not, and a 1 MiB embedding
    write_checkpoint(tmp_path / "single", 3, 2 * MiB, prefix="single_transformer_blocks", rest_bytes=1 * MiB)
    write_checkpoint(tmp_path / "dit", 4, 2 * MiB, prefix="transformer_blocks")
    os.replace(tmp_path / "single" / "model-00000.safetensors", tmp_path / "dit" / "model-00001.safetensors")
    config = tmp_path / "deploy.yaml"
    config.write_text("deployment: flux\nhost: {limit: 4GiB, reserve: 1GiB}\nworkload: {steps: 4}\n"
                      "components:\n  dit: {path: dit, layers: \"transformer_blocks.{i}.\", offload: layerwise}\n")
    (warning,) = [w for w in _warnings(capsys, config) if "(rest)" in w]
    assert warning == ('6.0 MiB of dit (40% of 15.0 MiB) is 3 block(s) "single_transformer_blocks.{i}." that no '
                       'layers pattern names: they fall into (rest) and never stream block by block; add '
                       '"single_transformer_blocks.{i}." in components.dit.layers')
    config.write_text(config.read_text().replace('"transformer_blocks.{i}."',
                                                 '["transformer_blocks.{i}.", "single_transformer_blocks.{i}."]'))
    assert not [w for w in _warnings(capsys, config) if "(rest)" in w]


def test_a_large_rest_of_embeddings_alone_is_no_missed_family(tmp_path, capsys):
    """A tiny model's embeddings and heads are a fifth of it or more (the README's example);
    they hold no numbered family, so nothing is said about its pattern."""
    write_checkpoint(tmp_path / "dit", 4, 1 * MiB, prefix="transformer_blocks", rest_bytes=2 * MiB)
    config = tmp_path / "deploy.yaml"
    config.write_text("deployment: flux\nhost: {limit: 4GiB, reserve: 1GiB}\nworkload: {steps: 4}\n"
                      "components:\n  dit: {path: dit, layers: \"transformer_blocks.{i}.\", offload: layerwise}\n")
    assert not [w for w in _warnings(capsys, config) if "(rest)" in w]


def test_a_pin_cap_of_zero_is_named_as_the_cause_of_a_zero_budget(write_config, capsys):
    path = write_config("deployment: x\nworkload: {steps: 4}\nhost: {limit: 8GiB, reserve: 1GiB, max_pinned: 0}\n"
                        "components:\n  dit: {size: 4GiB, layers: 8, offload: layerwise}\n")
    (line,) = [w for w in _warnings(capsys, path) if w.startswith("host budget is 0")]
    assert line.startswith("host budget is 0: host.max_pinned is 0 (") and "deploy.yaml:3)" in line
    assert "7.0 GiB is free; raise host.max_pinned" in line and "reach the limit" not in line


def test_a_declared_plan_names_an_adapter_file_it_does_not_have(write_config, capsys):
    path = write_config("deployment: x\nworkload: {steps: 4}\nhost: {limit: 8GiB, reserve: 1GiB}\n"
                        "components:\n  dit: {size: 4GiB, layers: 8, lora_targets: 1GiB, offload: layerwise}\n"
                        "lora:\n  adapters: [{path: loras/turbo.safetensors}]\n")
    (line,) = [w for w in _warnings(capsys, path) if w.startswith("adapter ")]
    assert os.path.join("loras", "turbo.safetensors") in line and "deploy.yaml:7)" in line and "does not exist" in line


def test_the_executor_moves_each_streamed_components_own_blocks():
    plan = build_plan(load_config(os.path.join(REPO, "configs", "wan22-a14b-48g.yaml"), environ={}), environ={})
    roles = plan_roles(plan, 1)
    low = roles["dit_low"]
    assert low.resident == plan.device.part("dit_low").resident_layers and len(low.resident) == 4
    assert len(low.pinned) + len(low.kept) + len(low.released) == 36 and low.moves == 40
    assert roles["dit_high"].resident == tuple(f"layers.{i}" for i in range(40))


def test_one_missed_block_and_a_too_narrow_pattern_are_named_by_plan_and_by_a_start_alike(tmp_path, capsys):
    """A model with one block of a kind (the README's tiny Flux: one double, one single block):
    the missed single block is named though it is one, a pattern narrower than its blocks
    (``transformer_blocks.{i}.attn.``) is told to be replaced, and a start on the live model
    (names from its parameters) says what the plan says; with both families, neither warns."""
    import planners
    from tests.clients import tiny_models as tm

    pytest.importorskip("diffusers", reason="the tiny Flux needs diffusers (pip install hostmem[test])")
    model = tm.save_model("flux", tmp_path / "flux", torch.bfloat16)
    config = tmp_path / "deploy.yaml"

    def rest_lines(layers: str) -> tuple[list[str], list[str]]:
        config.write_text("deployment: flux\nhost: {limit: 4GiB, reserve: 1GiB}\nworkload: {steps: 4}\n"
                          f"components:\n  dit: {{path: {model}, layers: {layers}, offload: layerwise}}\n")
        planned = [w for w in _warnings(capsys, config) if "(rest)" in w]
        started = planners.start(str(config), {"dit": tm.load_model("flux", model, torch.bfloat16)}, quiet=True,
                                  pin=False)
        return planned, [w for w in started.plan.warnings if "(rest)" in w]

    planned, started = rest_lines('"transformer_blocks.{i}."')
    assert planned == started and len(planned) == 1 and '1 block(s) "single_transformer_blocks.{i}."' in planned[0]
    planned, started = rest_lines('["transformer_blocks.{i}.attn.", "single_transformer_blocks.{i}."]')
    assert planned == started and len(planned) == 1
    assert "replace 'transformer_blocks.{i}.attn.' with 'transformer_blocks.{i}.'" in planned[0]
    assert rest_lines('["transformer_blocks.{i}.", "single_transformer_blocks.{i}."]') == ([], [])


def test_a_sequentials_numbered_layer_and_a_few_small_refiner_blocks_are_no_missed_family(tmp_path, capsys):
    """Wan's original names hold ``time_projection.1.weight`` (a Sequential's Linear, 40% of a
    block) and HunyuanVideo's two token-refiner blocks (under 2% of the model) lie outside the
    patterns by design: neither is a block the pattern missed."""
    from tests.conftest import write_safetensors

    block = torch.ones(512, 1024, dtype=torch.bfloat16)  # 1 MiB
    tensors = {f"blocks.{i}.self_attn.q.weight": block.clone() for i in range(10)}
    tensors["time_projection.1.weight"] = torch.ones(200, 1024, dtype=torch.bfloat16)
    tensors.update({f"txt_in.refiner_blocks.{i}.attn.qkv.weight": torch.ones(50, 1024, dtype=torch.bfloat16)
                    for i in range(2)})
    (tmp_path / "dit").mkdir()
    write_safetensors(tmp_path / "dit" / "model.safetensors", tensors)
    config = tmp_path / "deploy.yaml"
    config.write_text("deployment: wan\nhost: {limit: 4GiB, reserve: 1GiB}\nworkload: {steps: 4}\n"
                      "components:\n  dit: {path: dit, layers: \"blocks.{i}.\", offload: layerwise}\n")
    assert not [w for w in _warnings(capsys, config) if "(rest)" in w]


@pytest.mark.parametrize("served, copied", [(None, 0), ("bf16", 0), ("fp32", 2)])
def test_a_checkpoint_served_in_another_dtype_is_planned_as_copies_at_the_served_size(tmp_path, capsys, served, copied):
    """``components.NAME.dtype`` other than the file's: ``from_pretrained(torch_dtype=...)``
    casts at load, so each cast weight is a copy (anonymous) at the served size, whatever
    the load; a plan that counted the file's mapped bytes said "fits, committed 0 B" for
    fp32 experts served as bf16, which the host could not hold."""
    write_checkpoint(tmp_path / "dit", 4, 2 * MiB, prefix="transformer_blocks")  # 8 MiB of bf16
    config = tmp_path / "deploy.yaml"
    dtype = f", dtype: {served}" if served else ""
    config.write_text("deployment: cast\nhost: {limit: 1034MiB, reserve: 1GiB}\nworkload: {steps: 4}\n"
                      f"components:\n  dit: {{path: dit, layers: \"transformer_blocks.{{i}}.\", offload: layerwise{dtype}}}\n")
    assert main(["plan", str(config), "--json"]) in (0, 1)
    found = json.loads(capsys.readouterr().out)
    assert found["components"]["dit"]["anonymous"] == copied * 8 * MiB
    assert found["components"]["dit"]["weights_bytes"] == (copied or 1) * 8 * MiB
    assert found["fits"] is (copied == 0)


def test_a_component_kept_whole_past_the_vram_is_named_not_the_streamed_one(write_config, capsys):
    path = write_config("deployment: x\nworkload: {steps: 4}\nhost: {limit: 128GiB, reserve: 4GiB}\n"
                        "device: {vram: 24GB, reserve: 1GiB}\ncomponents:\n"
                        "  dit: {size: 20GiB, layers: 20, offload: layerwise}\n"
                        "  text_encoder: {size: 28GiB, layers: 24, offload: none}\n")
    (line,) = [w for w in _warnings(capsys, path) if w.startswith("device: the plan needs")]
    assert "what offload: none keeps there whole is more than it holds: text_encoder (30.1 GB" in line
    assert "(offload: full)" in line and "while dit runs" not in line


def test_at_the_boundary_the_verdict_shows_enough_digits_to_tell_the_sides_apart(write_config, capsys):
    path = write_config("deployment: x\nworkload: {steps: 4}\nhost: {limit: 4136MiB, reserve: 4GiB}\n"
                        "components:\n  dit: {size: 50MiB, layers: 4, offload: layerwise, load: copied}\n")
    main(["plan", str(path)])
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "fits: no: committed 50.00 MiB + reserve 4.00 GiB > limit 4.04 GiB: killed at the first request"


def test_at_the_boundary_the_device_figures_show_enough_digits_to_tell_the_sides_apart(write_config, capsys):
    path = write_config("deployment: x\nworkload: {steps: 4}\nhost: {limit: 128GiB, reserve: 4GiB}\n"
                        "device: {vram: 24GiB, reserve: 2GiB}\n"
                        "components:\n  dit: {size: 22538MiB, layers: 4, offload: none}\n")  # 10 MiB over
    main(["plan", str(path)])
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("fits: no: device: 25.78 GB (24.01 GiB) needed > VRAM 25.77 GB (24.00 GiB) "), first
    (peak,) = [line for line in out.splitlines() if line.strip().startswith("peak ")]
    assert peak.strip().startswith("peak 25.78 GB (24.01 GiB) = reserve and kept "), peak
    assert "device plan: VRAM 25.77 GB (24.00 GiB)" in out
    assert "of device memory at its peak, 10 MB (10.0 MiB) more than device.vram 25.77 GB (24.00 GiB)" in out


def test_a_shortfall_of_a_hundred_kib_still_shows_two_different_figures(write_config, capsys):
    path = write_config("deployment: x\nworkload: {steps: 4}\nhost: {limit: 128GiB, reserve: 4GiB}\n"
                        "device: {vram: 24GiB, reserve: 2GiB}\n"
                        "components:\n  dit: {size: 23068772KiB, layers: 4, offload: none}\n")  # 100 KiB over
    main(["plan", str(path)])
    first = capsys.readouterr().out.splitlines()[0]
    needed, vram = first.split(" needed > VRAM ")
    assert needed.removeprefix("fits: no: device: ") != vram.split(" (reserve")[0], first
