"""The config loader under hostile input: only ConfigError, naming the file, and plans that add up.

Generated configs go through the real YAML loader and, when they load, through the
whole what-if plan, so an overflow in the plan's arithmetic shows up here too.
"""

from __future__ import annotations

import copy
import math
import time

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from planners.budget import read_host_limit
from planners.config import ConfigError, parse_config
from planners.deployment import plan_deployment
from planners.report import report_text
from planners.whatif import what_if_components

PATH = "deploy.yaml"
_SETTINGS = settings(database=None, deadline=None, max_examples=200)

BASE = {
    "deployment": "fuzz",
    "host": {"limit": "32GiB", "reserve": "4GiB", "max_pinned": "75%"},
    "device": {"vram": "12GiB", "reserve": "2GiB"},
    "transfer": {"pinned_h2d": "24GB/s", "pageable_h2d": "8GB/s", "disk_read": "3GB/s"},
    "workload": {"steps": 4, "passes_per_step": 1},
    "components": {
        "dit": {"size": "61.7GB", "layers": 208, "lora_targets": "38GB", "dtype": "bf16", "offload": "layerwise"},
        "text_encoder": {"size": "15GB", "layers": 28, "offload": "full"},
    },
    "lora": {"adapters": [{"path": "turbo.safetensors", "strength": 1.0}], "cache": {"enabled": True}},
}
LEAVES = [
    ("host", "limit"), ("host", "reserve"), ("host", "max_pinned"), ("device", "vram"), ("device", "reserve"),
    ("transfer", "pinned_h2d"), ("transfer", "disk_read"), ("workload", "steps"), ("workload", "passes_per_step"),
    ("components", "dit", "size"), ("components", "dit", "layers"), ("components", "dit", "lora_targets"),
    ("components", "dit", "prefetch"), ("components", "text_encoder", "size"),
    ("lora", "adapters", 0, "strength"), ("lora", "adapters", 0, "alpha"),
    # every other field and whole sections: a name, a flag, a list, a mapping where another kind belongs
    ("deployment",), ("host",), ("device",), ("transfer",), ("workload",), ("components",), ("lora",),
    ("components", "dit"), ("components", "dit", "dtype"), ("components", "dit", "offload"),
    ("lora", "component"), ("lora", "adapters"), ("lora", "adapters", 0), ("lora", "adapters", 0, "path"),
    ("lora", "adapters", 0, "rules"), ("lora", "adapters", 0, "strict"), ("lora", "adapters", 0, "rslora"),
    ("lora", "cache"), ("lora", "cache", "enabled"), ("lora", "cache", "root"), ("lora", "cache", "roots"),
    ("lora", "cache", "max_size"),
]
_values = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 10**400), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["1.5", ".inf", "-1GiB", "1e400", "9" * 400, "75%", "120%", "auto", "0", "8EiB", "24GB/s"]),
    st.text(max_size=12), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.lists(st.text(max_size=3), max_size=2), st.sampled_from(["dit", "text_encoder", "bf16", "layerwise"]),
)


def _put(data, path, value) -> None:
    """Set ``path`` to ``value``, unless an earlier change left no place there to set it."""
    holder = data
    for step in path[:-1]:
        try:
            holder = holder[step]
        except (KeyError, IndexError, TypeError):
            return
    last = path[-1]
    if isinstance(holder, dict) or (isinstance(holder, list) and isinstance(last, int) and len(holder) > last):
        holder[path[-1]] = value


def _plan_every_merge(config) -> None:
    host = read_host_limit(config)
    for merge in ("none", "in-place", "cached"):
        components, notes = what_if_components(config, merge)
        plan = plan_deployment(config, components, host, mode="what-if", merge=merge, notes=tuple(notes))
        assert plan.budget.bytes >= 0
        text = report_text(plan)
        assert "nan" not in text.split() and "inf" not in text.split()


def _load_or_config_error(text: str):
    try:
        return parse_config(text, PATH, environ={})
    except ConfigError as exc:
        assert str(exc).startswith(PATH)
        return None


@_SETTINGS
@given(changes=st.lists(st.tuples(st.sampled_from(LEAVES), _values), min_size=1, max_size=3))
def test_any_value_in_any_field_loads_and_plans_or_is_a_config_error(changes):
    data = copy.deepcopy(BASE)
    for path, value in changes:
        _put(data, path, value)
    config = _load_or_config_error(yaml.safe_dump(data))
    if config is not None:
        _plan_every_merge(config)


@_SETTINGS
@given(text=st.text(max_size=300))
def test_any_text_is_a_config_or_a_config_error(text):
    _load_or_config_error(text)


@pytest.mark.parametrize(
    "snippet, key",
    [
        ("limit: .inf", "host.limit"),
        ("limit: .nan", "host.limit"),
        (f"limit: {'9' * 400}", "host.limit"),
        ("limit: '1.5'", "host.limit"),
        (f"max_pinned: {'9' * 400}", "host.max_pinned"),
    ],
)
def test_overflowing_sizes_name_their_key(snippet, key):
    text = yaml.safe_dump(BASE).replace("limit: 32GiB", snippet)
    with pytest.raises(ConfigError) as info:
        parse_config(text, PATH, environ={})
    assert f"{key}:" in str(info.value) and str(info.value).startswith(f"{PATH}:")


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "1" * 400])
def test_a_non_finite_strength_is_refused(value):
    text = yaml.safe_dump(BASE).replace("strength: 1.0", f"strength: {value}")
    with pytest.raises(ConfigError, match=r"lora\.adapters\[0\]\.strength: .* not a finite number"):
        parse_config(text, PATH, environ={})


def test_a_self_referring_alias_and_an_alias_bomb_are_refused_at_once():
    with pytest.raises(ConfigError, match="alias"):
        parse_config("deployment: &a [*a]\n", PATH, environ={})
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 12)]
    started = time.perf_counter()
    with pytest.raises(ConfigError, match=r"deploy\.yaml:2: .*alias"):
        parse_config("\n".join(levels), PATH, environ={})
    assert time.perf_counter() - started < 5  # 9**12 nodes if expanded: refused before that


def test_deep_nesting_is_refused():
    with pytest.raises(ConfigError, match="nested more than|maximum nesting depth"):
        parse_config("a: " + "[" * 200 + "]" * 200, PATH, environ={})


def test_a_plan_of_the_largest_sizes_stays_finite():
    data = copy.deepcopy(BASE)
    biggest = 2**63 - 1
    data["host"] = {"limit": biggest, "reserve": 1, "max_pinned": 1}
    data["components"]["dit"].update(size=biggest, lora_targets=biggest, layers=10_000)
    data["components"]["text_encoder"].update(size=biggest, layers=10_000)
    data["workload"] = {"steps": 10_000, "passes_per_step": 100}
    config = parse_config(yaml.safe_dump(data), PATH, environ={})
    _plan_every_merge(config)
    assert math.isfinite(config.transfer.pinned_h2d)
