"""`layers` as the model has them: a list of block patterns (Flux's double and single blocks).

Planned by path from a real Flux transformer's checkpoint (diffusers' own names), every
block of both families is a block of the plan, in the order the model runs them, and
only what lies outside every block is the rest.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from planners.cli import main

FAMILIES = ["transformer_blocks.{i}.", "single_transformer_blocks.{i}."]


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory):
    pytest.importorskip("diffusers", reason="the Flux checkpoint is written by diffusers (pip install hostmem[test])")
    import torch
    from diffusers import FluxTransformer2DModel

    from tests.clients import tiny_models as tm

    folder = tmp_path_factory.mktemp("flux") / "transformer"
    torch.manual_seed(0)
    FluxTransformer2DModel(**dict(tm.FLUX, num_layers=2, num_single_layers=3)).save_pretrained(folder)
    return str(folder)


def _plan(capsys, tmp_path, folder: str, layers) -> tuple[dict, str]:
    config = tmp_path / "flux.yaml"
    config.write_text(textwrap.dedent(f"""
        deployment: flux
        workload: {{steps: 4}}
        host: {{limit: 8GiB, reserve: 1GiB}}
        device: {{vram: 0}}
        components:
          dit: {{path: {folder}, layers: {json.dumps(layers)}, offload: layerwise}}
        """))
    assert main(["plan", str(config), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert main(["plan", str(config)]) == 0
    return report, capsys.readouterr().out


def test_flux_by_path_has_both_block_families_in_run_order(capsys, tmp_path, flux_folder):
    report, text = _plan(capsys, tmp_path, flux_folder, FAMILIES)
    streamed = report["device_plan"]["streamed_layers"]
    assert streamed == ["transformer_blocks.0", "transformer_blocks.1", "single_transformer_blocks.0",
                        "single_transformer_blocks.1", "single_transformer_blocks.2", "(rest)"]
    assert report["components"]["dit"]["layers"] == 5
    from hostmem.safetensors.header import read_header
    from planners.checkpoint import checkpoint_files

    names = [n for f in checkpoint_files(flux_folder) for n in read_header(f).tensors]
    outside = [n for n in names if not n.startswith(("transformer_blocks.", "single_transformer_blocks."))]
    assert outside and not any("blocks" in n for n in outside)  # the rest holds only what no block holds
    assert "streamed 5 of 5 blocks, and the rest" in text  # the blocks as the components table counts them
    assert "transformer_blocks.0..1, single_transformer_blocks.0..2, (rest)" in text
    # one pattern alone leaves the single blocks in the rest: the plan sees two blocks
    one, _ = _plan(capsys, tmp_path, flux_folder, FAMILIES[0])
    assert one["components"]["dit"]["layers"] == 2


def test_a_block_pattern_that_matches_nothing_or_is_malformed_is_refused(capsys, tmp_path, flux_folder):
    config = tmp_path / "bad.yaml"
    for layers, said in ((FAMILIES + ["double_blocks.{i}."], "'double_blocks.{i}.' matches no tensor"),
                         (["blocks.{i}", "blocks"], "'blocks' is not a block pattern"),
                         (FAMILIES + FAMILIES[:1], "lists a pattern twice")):
        config.write_text(f"deployment: x\nworkload: {{steps: 1}}\ncomponents:\n"
                          f"  dit: {{path: {flux_folder}, layers: {json.dumps(layers)}, offload: layerwise}}\n")
        assert main(["plan", str(config)]) == 2
        err = capsys.readouterr().err
        assert "components.dit.layers" in err and said in err, err


def test_the_components_table_and_the_pin_plan_count_the_blocks_alike(capsys, tmp_path, flux_folder):
    """The tensors outside every block stream and pin as one unit; every table counts the
    blocks alike and names that unit apart (the device plan said "6 of 6 blocks" where the
    components table said 5)."""
    _, text = _plan(capsys, tmp_path, flux_folder, FAMILIES)
    (row,) = [line for line in text.splitlines() if line.split()[:3] == ["dit", "layerwise", "headers"]]
    assert row.split()[3:5] == ["5", "+"]
    pinned = [line for line in text.splitlines() if line.strip().startswith("dit ") and " of 5" in line]
    assert pinned, text
