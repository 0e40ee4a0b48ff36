"""The verdict: `plan --check` exit codes, JSON `fits`, and one price per figure.

Every shipped config and the demo's own config (its real files, planned by path) are
planned in place and cached; the text's first line, the JSON and the exit code must
say the same thing, and a plan that does not fit shows no transfer time.
"""

from __future__ import annotations

import glob
import json
import os
import re

import pytest

from hostmem.units import format_size
from planners.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIPPED = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))
MiB = 1024 * 1024

# What each shipped config's plan must say: the in-place merge of the two with a LoRA
# is killed while loading (the seed case, and the demo scaled from it); the cached one fits.
EXPECTED_FITS = {
    ("demo.yaml", "in-place"): False, ("demo.yaml", "cached"): True,
    ("minimax-h3-32g.yaml", "in-place"): False, ("minimax-h3-32g.yaml", "cached"): True,
    ("workstation-24g.yaml", "in-place"): True, ("workstation-24g.yaml", "cached"): True,
    ("flux1-dev-h100-32g.yaml", "in-place"): True, ("flux1-dev-h100-32g.yaml", "cached"): True,
    ("wan22-a14b-48g.yaml", "in-place"): True, ("wan22-a14b-48g.yaml", "cached"): True,
    ("qwen-image-tp4-128g.yaml", "in-place"): True, ("qwen-image-tp4-128g.yaml", "cached"): True,
}
NO_LORA = ("workstation", "flux1-dev", "wan22", "qwen-image")  # configs without adapters: no merge to price


def _plan(capsys, *argv) -> tuple[int, str]:
    code = main(["plan", *argv])
    return code, capsys.readouterr().out


@pytest.fixture(scope="module")
def demo_config(tmp_path_factory):
    """The demo's deployment written by the demo's own code at 64 MiB: real shards, a real adapter."""
    from planners.demo.run import SEED, scaled, write_config
    from planners.demo.synthetic import write_synthetic_set

    folder = str(tmp_path_factory.mktemp("demo"))
    files = write_synthetic_set(folder, 64 * MiB, rank=8, progress=False)
    limit = scaled(SEED["limit"], files.dit_bytes)
    return write_config(folder, files, limit, scaled(SEED["reserve"], files.dit_bytes), "demo-64m")


def _cases(demo_config):
    for path in SHIPPED:
        for merge in ("in-place", "cached"):
            yield path, merge, EXPECTED_FITS[(os.path.basename(path), merge)]
    yield demo_config, "in-place", False
    yield demo_config, "cached", True


def test_check_exit_codes_and_json_fits_agree_for_every_config(capsys, demo_config):
    assert {os.path.basename(p) for p in SHIPPED} == {name for name, _ in EXPECTED_FITS}, "a new config: add it"
    for path, merge, fits in _cases(demo_config):
        code, text = _plan(capsys, path, "--check", "--what-if", merge)
        assert code == (0 if fits else 1), (path, merge, text[:300])
        code_json, out = _plan(capsys, path, "--check", "--json", "--what-if", merge)
        report = json.loads(out)
        assert code_json == code and report["fits"] is fits, (path, merge)
        first = text.splitlines()[0]
        assert first.startswith("fits: yes: " if fits else "fits: no: ")
        if report["host"]["headroom"] is None:  # an auto limit is read anew by each run: its figures move
            assert first == report["verdict"]
        else:
            assert first.split(" within limit ")[0] == report["verdict"].split(" within limit ")[0]
        committed = report["budget"]["committed_bytes"]
        assert report["over_limit_bytes"] == max(0, committed - report["budget"]["limit_bytes"])
        if not fits:  # killed while loading: no transfer time as if it ran
            assert first == (f"fits: no: committed {format_size(committed)} > limit "
                             f"{format_size(report['budget']['limit_bytes'])}: killed while loading")
            assert report["transfer_s_per_request"] is None
            assert all(p["transfer_s_per_request"] is None for p in report["pin_plans"].values())
            table = text.split("pin plans:\n")[1].split("\n\n")[0]
            assert not re.search(r"\d+\.\d+ m?s\b", table), table
            assert "transfer: none, the plan does not fit" in table
        else:
            assert isinstance(report["transfer_s_per_request"], float)
        assert _plan(capsys, path, "--what-if", merge)[0] == 0  # without --check: a report, not a gate


def test_check_exits_2_for_a_bad_config(capsys, write_config):
    path = write_config("deployment: x\nhost: {limit: 1GiB, reserve: 2GiB}\n"
                        "components:\n  dit: {size: 1GiB, layers: 2, offload: layerwise}\n")
    assert main(["plan", path, "--check"]) == 2
    assert "host.reserve" in capsys.readouterr().err


def test_a_device_that_cannot_hold_the_window_does_not_fit(capsys, write_config):
    path = write_config("deployment: x\nworkload: {steps: 1}\nhost: {limit: 8GiB, reserve: 1GiB}\n"
                        "device: {vram: 600MiB, reserve: 100MiB}\n"
                        "components:\n  dit: {size: 4GiB, layers: 4, offload: layerwise, prefetch: 1}\n")
    code, out = _plan(capsys, path, "--check", "--json")
    report = json.loads(out)
    assert code == 1 and report["fits"] is False and report["over_limit_bytes"] == 0
    # a window of 2 blocks of 1 GiB on a 600 MiB device with a 100 MiB reserve: short by 2148 MiB - 500 MiB
    assert ("device: 2.3 GB (2.1 GiB) needed while dit runs (2.1 GB (2.0 GiB) in flight) > VRAM 629 MB (600.0 MiB)"
            in report["verdict"])
    assert "short by 1.6 GB (1.5 GiB)" in report["verdict"]
    assert report["device_plan"]["shortfall_bytes"] == 2148 * MiB - 600 * MiB


def test_committed_and_reserve_over_the_limit_is_killed_at_the_first_request(capsys, write_config):
    path = write_config("deployment: x\nworkload: {steps: 1}\nhost: {limit: 8GiB, reserve: 2GiB}\n"
                        "components:\n  dit: {size: 7GiB, layers: 4, offload: layerwise, load: copied}\n")
    code, out = _plan(capsys, path, "--check")
    assert code == 1
    assert out.splitlines()[0] == ("fits: no: committed 7.0 GiB + reserve 2.0 GiB > limit 8.0 GiB: "
                                   "killed at the first request")


def _figures(text: str, report: dict) -> dict:
    """The in-place merge's committed figure wherever the report states it."""
    out = {"budget": report["budget"]["committed"]["anonymous_bytes"]}
    for offer in report["offers"]:
        assert offer["applied_bytes"] == offer["anonymous_bytes"]  # the planner's own price: nothing to clamp
        out["offer"] = offer["anonymous_bytes"]
        out["offer note"] = re.search(r"in place it costs (\S+ \S+) anonymous", offer["note"]).group(1)
    for alternative in report["alternatives"]:
        out["alternative"] = alternative["committed_bytes"]
    if "compared (" in text:
        row = next(l for l in text.split("compared (")[1].splitlines() if "without the LoRA merge cache" in l)
        out["compared row"] = re.search(r"in-place\s+(\S+ \S+)", row).group(1)
    return out


@pytest.mark.parametrize("load", ["mapped", "copied"])
def test_the_in_place_merge_has_one_price_in_text_and_json(capsys, demo_config, write_config, load):
    """Budget, offer, offer note and the cached plan's comparison all read one figure."""
    declared = write_config(f"""
        deployment: x
        workload: {{steps: 4}}
        host: {{limit: 32GiB, reserve: 4GiB}}
        components:
          dit: {{size: 20GiB, layers: 10, offload: layerwise, lora_targets: 6GiB, load: {load}}}
        lora: {{adapters: [{{path: a.safetensors}}], cache: {{enabled: true}}}}
        """)
    configs = [p for p in SHIPPED if not any(name in p for name in NO_LORA)] + [demo_config, declared]
    for path in configs:
        _, in_place_text = _plan(capsys, path, "--what-if", "in-place")
        in_place = json.loads(_plan(capsys, path, "--json", "--what-if", "in-place")[1])
        _, cached_text = _plan(capsys, path, "--what-if", "cached")
        cached = json.loads(_plan(capsys, path, "--json", "--what-if", "cached")[1])
        price = in_place["budget"]["committed_bytes"] - cached["budget"]["committed_bytes"]
        assert price > 0, path
        figures = {**_figures(cached_text, cached), **_figures(in_place_text, in_place)}
        committed = in_place["budget"]["committed_bytes"]  # the in-place plan's own budget
        assert figures["budget"] == figures["alternative"] == committed, (path, figures)
        assert figures["compared row"] == format_size(committed), (path, figures)
        assert re.search(rf"- committed anonymous\s+{re.escape(format_size(committed))}\n", in_place_text)
        assert figures["offer"] == price and figures["offer note"] == format_size(price), (path, figures)
    targets = 6 * 1024**3
    assert price == (targets if load == "mapped" else 2 * targets)  # the copied base keeps an unmerge snapshot


def test_a_device_plan_on_a_machine_without_a_gpu_says_whose_it_is(capsys, tmp_path):
    from planners.budget import count_gpus

    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidiactl", "nvidia-uvm", "nvidia0", "nvidia1", "null"):
        (dev / name).touch()
    assert count_gpus(str(dev)) == 2 and count_gpus(str(tmp_path / "none")) == 0
    demo = os.path.join(REPO, "configs", "demo.yaml")
    code, out = _plan(capsys, demo, "--json")
    gpus = json.loads(out)["host"]["gpus"]
    assert gpus == count_gpus()
    text = _plan(capsys, demo)[1]
    said = "this machine has no GPU: this is the device plan of the host the config describes" in text
    assert said is (gpus == 0)


def test_an_offer_larger_than_what_the_component_holds_shows_what_it_gives_back(capsys, write_config):
    """A provider's own figure (2 x targets by default) is clamped to the component's anonymous bytes."""
    from lora_cache.provider import LoraCacheProvider
    from planners.budget import resolve_host_limit
    from planners.config import load_config
    from planners.deployment import plan_deployment
    from planners.report import report_dict, report_text
    from planners.whatif import what_if_components

    config = load_config(write_config("""
        deployment: x
        workload: {steps: 4}
        host: {limit: 32GiB, reserve: 4GiB}
        components:
          dit: {size: 20GiB, layers: 10, offload: layerwise, lora_targets: 6GiB}
        """))
    components, _ = what_if_components(config, "in-place")
    plan = plan_deployment(config, components, resolve_host_limit(32 * 1024**3, 64 * 1024**3, None),
                           merge="in-place", providers=[LoraCacheProvider("dit", 6 * 1024**3, layers=10)])
    (offer,) = report_dict(plan)["offers"]
    assert offer["anonymous_bytes"] == 12 * 1024**3 and offer["applied_bytes"] == 6 * 1024**3
    row = next(l for l in report_text(plan).split("offers:")[1].splitlines() if l.lstrip().startswith("lora_cache  "))
    assert row.split()[2:4] == ["6.0", "GiB"]
