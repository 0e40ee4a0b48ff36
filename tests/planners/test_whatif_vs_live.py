"""A plan from a checkpoint's headers matches the plan measured after loading it."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import hostmem
from planners.budget import read_host_limit
from planners.config import load_config
from planners.deployment import plan_deployment
from planners.report import report_dict
from planners.sizes import from_declared, from_ledger
from planners.startup import plan_loaded
from planners.whatif import predict, what_if_components

from .conftest import MiB, mapped_module, write_checkpoint

# 24 DiT layers of 5 MiB + a 1 MiB rest in 3 files, a 4-layer 32 MiB text encoder: 153 MiB.
# The host leaves 100 MiB of room: the pins are bounded and the DiT cannot all be cached.
CONFIG = """
deployment: what-if-vs-live
host: {limit: 2148MiB, reserve: 2GiB, max_pinned: 100%}
device: {vram: 32MiB, reserve: 8MiB}
workload: {steps: 4}
components:
  dit: {path: ckpt/dit, layers: "blocks.{i}.", offload: layerwise, prefetch: 1, lora_targets: ["blocks.*.w0"]}
  text_encoder: {path: ckpt/te, layers: "enc.{i}.", offload: full}
"""


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    root = tmp_path_factory.mktemp("whatif")
    write_checkpoint(root / "ckpt" / "dit", 24, 5 * MiB, rest_bytes=MiB, files=3)
    write_checkpoint(root / "ckpt" / "te", 4, 8 * MiB, prefix="enc")
    path = root / "deploy.yaml"
    path.write_text(CONFIG.lstrip())
    return load_config(path, environ={}), root


def _loaded(root):
    modules = {"dit": mapped_module(root / "ckpt" / "dit"), "text_encoder": mapped_module(root / "ckpt" / "te")}
    for module in modules.values():
        for p in module.parameters():
            torch.sum(p)  # read every page, as a first request would
    return modules


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 0.01 * max(abs(a), abs(b))


def test_the_what_if_plan_from_headers_matches_the_live_plan_within_1_percent(deployment, caplog):
    config, root = deployment
    sizes, _ = what_if_components(config, "none")
    before = report_dict(plan_deployment(config, sizes, read_host_limit(config)))
    modules = _loaded(root)
    with caplog.at_level(logging.INFO, logger="hostmem"):
        after = report_dict(plan_loaded(config, modules))
    reports = [r for r in caplog.records if r.getMessage().startswith("host memory plan")]
    assert len(reports) == 1 and "pin plans:" in reports[0].getMessage()  # the report, logged once
    assert after["mode"] == "live" and after["budget"]["committed"]["process_excess_bytes"] == 0
    assert before["budget"]["bytes"] == pytest.approx(100 * MiB, rel=0.01)
    assert _close(before["budget"]["bytes"], after["budget"]["bytes"])
    for name in ("dit", "text_encoder"):
        b, a = before["components"][name], after["components"][name]
        for key in ("total", "file_backed", "anonymous", "weights_bytes", "lora_target_bytes"):
            assert abs(b[key] - a[key]) <= 0.01 * b["total"], (name, key, b[key], a[key])
        bp, ap = before["pin_plans"][name], after["pin_plans"][name]
        assert bp["pinned_layers"] == ap["pinned_layers"]
        assert _close(bp["pinned_bytes"], ap["pinned_bytes"])
        assert _close(bp["transfer_s_per_request"], ap["transfer_s_per_request"])
    assert before["device_plan"] == after["device_plan"]
    assert len(after["pin_plans"]["dit"]["pinned_layers"]) == 20  # 100 MiB of 5 MiB layers


def test_an_in_place_merge_turns_exactly_the_predicted_bytes_anonymous(deployment):
    config, root = deployment
    predicted = what_if_components(config, "in-place")[0]["dit"]
    assert predicted.lora_target_bytes == 24 * 5 * MiB // 2
    assert predicted.extra.anonymous == predicted.lora_target_bytes  # the unmerge snapshot
    module = mapped_module(root / "ckpt" / "dit")
    snapshot = []
    for name, param in module.named_parameters():
        if name.endswith(".w0"):
            snapshot.append(param.detach().clone())
            param.data = param.detach() + 1  # what a merge into read-only weights must do
    measured = from_ledger(hostmem.account({"dit": module}).components["dit"], "layerwise", "blocks.{i}.")
    by_name = {u.name: u for u in predicted.units}
    for unit in measured.units:
        expected = by_name[unit.name].residency.anonymous
        assert abs(unit.residency.anonymous - expected) <= 0.01 * unit.nbytes, unit.name
    assert sum(s.numel() * s.element_size() for s in snapshot) == predicted.extra.anonymous


def test_declared_sizes_and_headers_agree_on_the_same_checkpoint(deployment):
    config, root = deployment
    headers = what_if_components(config, "none")[0]["text_encoder"]
    declared = predict(from_declared("text_encoder", "full", 32 * MiB, 4), "mapped")
    assert headers.weights_bytes == declared.weights_bytes
    assert [u.nbytes for u in headers.units] == [u.nbytes for u in declared.units]
    assert headers.residency == declared.residency
    assert os.path.isdir(root / "ckpt" / "te")
