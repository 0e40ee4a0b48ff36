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
from tests.fresh_fork import CLIENTS  # noqa: E402

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
                      env={**os.environ, "PYTHONPATH": REPO, "PYTHONWARNINGS": "ignore"}, forked_from=CLIENTS)
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


def test_a_merge_the_server_ran_by_hand_is_held_to_the_config(deployment, tmp_path):
    """Adapters or a cache root other than the config's: the plan says it is not the deployment's."""
    import lora_cache
    from planners import load_config, plan_loaded

    config_path, model, root = deployment
    config = load_config(config_path)
    plain = os.path.join(root, "adapters", "diffusers_plain", "pytorch_lora_weights.safetensors")
    dit = tm.load_model("flux", model)
    stats = lora_cache.merge(dit, [(plain, 0.8)], cache_root=tmp_path / "elsewhere", progress=False)
    try:
        warnings = plan_loaded(config, {"dit": dit}, merge_stats=stats, quiet=True).warnings
    finally:
        lora_cache.unmerge(dit)
    said = [w for w in warnings if w.startswith("lora_cache.merge ")]
    assert len(said) == 2, warnings
    assert said[0].startswith(f"lora_cache.merge was given {plain}, but lora.adapters (") and "deploy.yaml:" in said[0]
    assert said[1].startswith(f"lora_cache.merge used the cache under {tmp_path / 'elsewhere'}, but lora.cache (")
    matching = config_adapters_merge(config, tm.load_model("flux", model))
    assert not [w for w in matching if w.startswith("lora_cache.merge ")], matching


def config_adapters_merge(config, dit) -> tuple:
    """The warnings of a plan whose merge took the config's own adapters and roots, by hand."""
    import lora_cache
    from planners import plan_loaded
    from planners.server_start import config_adapters

    stats = lora_cache.merge(dit, config_adapters(config), list(config.lora.cache.roots), progress=False)
    try:
        return plan_loaded(config, {"dit": dit}, merge_stats=stats, quiet=True).warnings
    finally:
        lora_cache.unmerge(dit)
