"""``planners.start``: one call merges the config's adapters, accounts, plans, pins, reports.

Each start runs in a fresh interpreter with no logging configured, as a server's first
lines would: the report must reach stderr, and the second start must find every merged
layer in the cache the first one built under the config's root.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest

pytest.importorskip("diffusers", reason="the tiny pipeline needs diffusers (pip install hostmem[test])")
pytest.importorskip("peft", reason="the tiny adapter is written by peft (pip install hostmem[test])")

from tests.clients import tiny_models as tm  # noqa: E402
from tests.conftest import run_python  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SERVER = """
import json, sys
import planners
from tests.clients import tiny_models as tm

model = tm.load_model("flux", sys.argv[2])
started = planners.start(sys.argv[1], tm.pipeline("flux", model))
s = started.merge_stats
print(json.dumps({"hit": s.hit, "built": s.built, "layers": s.layers, "fits": started.plan.fits,
                  "pinned": started.pins.locked_bytes if started.pins else None,
                  "components": sorted(started.components)}))
"""


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    root = tmp_path_factory.mktemp("start")
    model = tm.save_model("flux", root / "model")
    adapters = tm.write_adapters("flux", model, root / "adapters")
    config = root / "deploy.yaml"
    config.write_text(textwrap.dedent(f"""
        deployment: tiny-flux
        workload: {{steps: 2}}
        host: {{limit: 16GiB, reserve: 4GiB}}
        device: {{vram: 0}}
        components:
          dit:
            path: model
            layers: ["transformer_blocks.{{i}}.", "single_transformer_blocks.{{i}}."]
            offload: layerwise
        lora:
          adapters: [{{path: {adapters['diffusers_meta']}/pytorch_lora_weights.safetensors, strength: 0.8}}]
          cache: {{root: cache}}
        """))
    return str(config), model, root


def _start(config: str, model: str) -> tuple[dict, str]:
    done = run_python(SERVER, config, model, cwd=REPO, timeout=300,
                      env={**os.environ, "PYTHONPATH": REPO, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_one_call_merges_through_the_configs_cache_and_prints_the_report(deployment):
    config, model, root = deployment
    first, report = _start(config, model)
    assert first["components"] == ["dit"] and first["fits"] is True
    assert first["layers"] > 0 and first["built"] == first["layers"] and first["hit"] == 0
    assert os.path.isdir(root / "cache")  # the config's root (relative to the config), not the default
    assert "host memory plan\nfits: yes: " in report  # no logging configured: printed, verdict first
    assert "merge: cached" in report and "LoRA merge (cache " in report
    second, report = _start(config, model)
    assert second["hit"] == second["layers"] == first["layers"] and second["built"] == 0
    merge = report.split("LoRA merge (")[1].split("\n\n")[0].splitlines()
    assert merge[2].split()[:3] == [str(first["layers"]), str(first["layers"]), "0"]  # tensors, hit, built
    assert merge[2].split()[-1] == "-"  # all hits: no merge rate to speak of
    assert merge[3] == "  every weight tensor came from the cache: nothing merged, nothing written"


def test_quiet_prints_nothing_and_a_pipeline_without_the_component_is_named(deployment, capsys):
    config, model, _ = deployment
    import planners

    loaded = tm.load_model("flux", model)
    started = planners.start(config, {"dit": loaded}, quiet=True, pin=False)
    assert capsys.readouterr().err == "" and started.pins is None and started.plan.fits
    with pytest.raises(ValueError, match=r"components dit are not attributes of the FluxPipeline given"):
        planners.start(config, tm.pipeline("flux", None))
