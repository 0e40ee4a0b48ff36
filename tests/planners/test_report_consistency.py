"""One source for every figure: what the text and JSON reports print is the plan object's.

For each shipped config (and its other merges), the JSON's figures equal the plan's fields,
the text prints the same figures formatted, and each time per request is the time of the
bytes the plan says move: pinned at the pinned rate, the rest pageable, and what it says is
read from disk at the disk rate, on top.
"""

from __future__ import annotations

import glob
import os

import pytest

from hostmem.units import format_size
from planners.plan_build import build_plan
from planners.config import load_config
from planners.report import report_dict, report_text
from planners.verdict import device_digits, format_device

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))


def _plans():
    for path in CONFIGS:
        config = load_config(path, environ={})
        merges = ("none", "in-place", "cached") if config.lora is not None else (None,)
        for merge in merges:
            yield os.path.basename(path), merge, build_plan(config, merge, environ={})


PLANS = list(_plans())


def _moved_bytes(plan, name) -> int:
    part = plan.device.part(name)
    return part.streamed_bytes if part is not None else plan.components[name].weights_bytes


@pytest.mark.parametrize("name, merge, plan", PLANS, ids=[f"{n}-{m}" for n, m, _ in PLANS])
def test_each_time_per_request_is_the_time_of_the_bytes_the_plan_says_move(name, merge, plan):
    rates = plan.transfer
    for component, p in plan.pins.plans.items():
        pageable = _moved_bytes(plan, component) - p.pinned_bytes
        per_move = p.pinned_bytes / rates.pinned_h2d + pageable / rates.pageable_h2d
        expected = p.moves_per_request * per_move + p.disk_bytes_per_request / rates.disk_read
        assert p.transfer_s_per_request == pytest.approx(expected, rel=1e-9), (component, p)


@pytest.mark.parametrize("name, merge, plan", PLANS, ids=[f"{n}-{m}" for n, m, _ in PLANS])
def test_the_json_is_the_plan_object(name, merge, plan):
    r = report_dict(plan)
    assert r["fits"] == plan.fits and r["verdict"] == plan.verdict.line
    assert r["budget"]["bytes"] == plan.budget.bytes and r["budget"]["room_bytes"] == plan.budget.room
    d = r["device_plan"]
    assert (d["peak_bytes"], d["kept_bytes"], d["shortfall_bytes"]) == (
        plan.device.peak_bytes, plan.device.kept_bytes, plan.device.shortfall)
    for part in plan.device.parts:
        assert d["components"][part.component]["streamed_bytes"] == part.streamed_bytes
    for component, p in plan.pins.plans.items():
        j = r["pin_plans"][component]
        assert (j["pinned_bytes"], j["disk_bytes_per_request"], j["page_cache_bytes"]) == (
            p.pinned_bytes, p.disk_bytes_per_request, p.page_cache_bytes)
        assert j["transfer_s_per_request"] == (p.transfer_s_per_request if plan.fits else None)
    total = sum(p.transfer_s_per_request for p in plan.pins.plans.values())
    assert r["transfer_s_per_request"] == (pytest.approx(total) if plan.fits else None)


@pytest.mark.parametrize("name, merge, plan", PLANS, ids=[f"{n}-{m}" for n, m, _ in PLANS])
def test_the_text_prints_the_plan_objects_figures(name, merge, plan):
    text = report_text(plan)
    assert text.splitlines()[0] == plan.verdict.line
    section = text.split("pin plans:\n")[1].split("\n\n")[0]
    rows = {line.split()[0]: line for line in section.splitlines()[1:] if line.split()[1] != "pinned:"}
    for component, p in plan.pins.plans.items():
        row = rows[component]
        for figure in (format_size(p.pinned_bytes), format_size(p.page_cache_bytes),
                       format_size(p.disk_bytes_per_request)):
            assert figure in row, (component, figure, row)
        if plan.fits:
            seconds = p.transfer_s_per_request
            shown = f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1000:.1f} ms"
            assert shown in row, (component, shown, row)
    if plan.device.vram:
        n = device_digits(plan.device.vram, plan.device.peak_bytes)
        assert (f"peak {format_device(plan.device.peak_bytes, n)} = reserve and kept "
                f"{format_device(plan.device.kept_bytes)}") in text
    disk = [n for n in plan.pins.notes + plan.warnings if "from disk per request" in n]
    for line in disk:  # every disk figure a line says is the pin plan's
        component = line.split(" reads ")[0].split()[-1]
        assert f"reads {format_size(plan.pins.plans[component].disk_bytes_per_request)} from disk" in line, line


@pytest.mark.parametrize("name", sorted({n for n, m, _ in PLANS if m == "in-place"}))
def test_an_offer_is_priced_as_the_plan_it_would_give(name):
    """The LoRA cache's offer beside an in-place plan is the cached plan: the same budget,
    pins and time per request, whichever report shows it."""
    plans = {m: p for n, m, p in PLANS if n == name}
    (offer,) = plans["in-place"].offers
    cached = plans["cached"]
    assert (offer.budget_bytes, offer.pinned_bytes) == (cached.budget.bytes, cached.pins.pinned_bytes)
    assert offer.transfer_s_per_request == pytest.approx(cached.pins.transfer_s_per_request, rel=1e-12)
    (alternative,) = cached.alternatives
    assert alternative.budget_bytes == plans["in-place"].budget.bytes
    assert alternative.transfer_s_per_request == pytest.approx(plans["in-place"].pins.transfer_s_per_request)
