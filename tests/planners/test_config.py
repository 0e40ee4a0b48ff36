"""Deployment configs: parsing, validation errors that name file, key and line, overrides."""

from __future__ import annotations

import glob
import os
import shutil

import pytest

from planners.config import ENV_OVERRIDES, ConfigError, load_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GOOD = """
deployment: test
host:
  limit: 32GiB
  reserve: 4GiB
  max_pinned: 75%
device:
  vram: 12GiB
  reserve: 2GiB
transfer:
  pinned_h2d: 24GB/s
workload:
  steps: 4
  passes_per_step: 2
components:
  dit:
    size: 61.7GB
    layers: 208
    lora_targets: 38GB
    offload: layerwise
  text_encoder:
    size: 15GB
    offload: full
"""


def test_a_good_config_parses_into_bytes_and_fractions(write_config):
    config = load_config(write_config(GOOD), environ={})
    assert config.host.limit == 32 * 1024**3
    assert config.host.reserve == 4 * 1024**3
    assert config.host.max_pinned(config.host.limit) == 24 * 1024**3
    assert config.device.vram == 12 * 1024**3
    assert config.transfer.pinned_h2d == 24e9
    assert config.transfer.pageable_h2d == 8e9  # the documented default
    assert config.workload.passes == 8
    dit = config.components["dit"]
    assert (dit.size, dit.layer_count, dit.lora_target_bytes) == (61_700_000_000, 208, 38_000_000_000)
    assert config.streamed is dit and config.merge_target is dit


@pytest.mark.parametrize(
    "old, new, key, line, words",
    [
        ("  reserve: 4GiB\n", "  reserv: 4GiB\n", "host.reserv", 4, "did you mean 'reserve'"),
        ("  limit: 32GiB\n", "  limit: 32 parsecs\n", "host.limit", 3, "not a size"),
        ("  max_pinned: 75%\n", "  max_pinned: 175%\n", "host.max_pinned", 5, "between 0% and 100%"),
        ("  reserve: 4GiB\n", "  reserve: 40GiB\n", "host.reserve", 4, "lower the reserve"),
        ("  steps: 4\n", "  steps: four\n", "workload.steps", 12, "whole number"),
        ("    offload: full\n", "    offload: sometimes\n", "components.text_encoder.offload", 22, "layerwise, full"),
        ("    size: 15GB\n", "    path: no/such/folder\n", "components.text_encoder.path", 21, "does not exist"),
        ("  passes_per_step: 2\n", "  passes_per_step: 2\n  steps: 5\n", "workload.steps", 14, "given twice"),
        # a merge is charged into one component: another's lora_targets would be charged nothing
        ("    size: 15GB\n", "    size: 15GB\n    lora_targets: 5GB\n", "components.text_encoder.lora_targets", 22,
         "never into 'text_encoder'"),
        ("    offload: full\n", "    offload: full\nlora:\n  component: text_encoder\n", "components.dit.lora_targets",
         18, "charges a LoRA merge into 'text_encoder'"),
        # accepted and never used before: a window of a component that moves whole, an empty name
        ("    offload: full\n", "    offload: full\n    prefetch: 7\n", "components.text_encoder.prefetch", 23,
         "read-ahead window of a streamed component"),
        ("deployment: test\n", "deployment: ''\n", "deployment", 1, "is empty"),
        # a bare number is bytes: 24 GB meant, 24 bytes read, and the reserve blamed for it
        ("  vram: 12GiB\n", "  vram: 24\n", "device.vram", 7, "a number without a unit, which is 24 bytes; write the "
         "unit, e.g. 24GB or 24GiB"),
        ("  limit: 32GiB\n", "  limit: 32\n", "host.limit", 3, "which is 32 bytes"),
        ("  max_pinned: 75%\n", f"  max_pinned: {'9' * 400}\n", "host.max_pinned", 5, "(400 characters)"),
        # a component of no bytes, or of blocks of none, planned as one that fits
        ("    size: 61.7GB\n", "    size: 0\n", "components.dit.size", 16, "leaves a block no bytes"),
        ("    size: 61.7GB\n", "    size: 100B\n", "components.dit.size", 16, "100B' over 208 block(s)"),
    ],
)
def test_errors_name_file_key_and_line(write_config, old, new, key, line, words):
    assert old in GOOD
    path = write_config(GOOD.replace(old, new, 1))
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ={})
    message = str(caught.value)
    assert message.startswith(f"{path}:{line}: {key}: "), message
    assert words in message


def test_a_component_needs_a_path_or_declared_sizes(write_config):
    path = write_config(GOOD.replace("    size: 15GB\n", ""))
    with pytest.raises(ConfigError, match=r":20: components.text_encoder: give either path"):
        load_config(path, environ={})


def test_a_layerwise_checkpoint_needs_a_layer_pattern(write_config, tmp_path):
    (tmp_path / "ckpt").mkdir()
    text = GOOD.replace("    size: 61.7GB\n    layers: 208\n    lora_targets: 38GB\n", "    path: ckpt\n    layers: 208\n")
    with pytest.raises(ConfigError, match=r"components.dit.layers: 208 is not a block pattern"):
        load_config(write_config(text), environ={})


def test_relative_paths_start_at_the_config_folder(write_config, tmp_path):
    (tmp_path / "ckpt").mkdir()
    text = GOOD.replace("    size: 61.7GB\n    layers: 208\n", '    path: ckpt\n    layers: "blocks.{i}."\n')
    text = text.replace("    lora_targets: 38GB\n", '    lora_targets: ["*.attn.*"]\n')
    config = load_config(write_config(text), environ={})
    assert config.components["dit"].path == os.fspath(tmp_path / "ckpt")
    assert config.components["dit"].lora_target_patterns == ("*.attn.*",)


def test_environment_overrides_documented_keys_only(write_config):
    path = write_config(GOOD)
    config = load_config(path, environ={"HOSTMEM_HOST_LIMIT": "48GiB", "HOSTMEM_MAX_PINNED": "16GiB",
                                        "HOSTMEM_UNKNOWN": "1", "HOME": "/"})
    assert config.host.limit == 48 * 1024**3
    assert config.host.max_pinned(config.host.limit) == 16 * 1024**3
    assert config.origin.overrides == {"host.limit": "HOSTMEM_HOST_LIMIT", "host.max_pinned": "HOSTMEM_MAX_PINNED"}
    assert set(ENV_OVERRIDES) == {"HOSTMEM_HOST_LIMIT", "HOSTMEM_HOST_RESERVE", "HOSTMEM_MAX_PINNED",
                                  "HOSTMEM_DEVICE_VRAM"}


@pytest.mark.parametrize("old, new, variable, key", [
    ("host:\n  limit: 32GiB\n", "host: 8GiB\nhostx:\n  limit: 32GiB\n", "HOSTMEM_MAX_PINNED", "host"),
    ("device:\n  vram: 12GiB\n", "device: 24GB\ndevicex:\n  vram: 12GiB\n", "HOSTMEM_DEVICE_VRAM", "device"),
])
def test_an_override_never_hides_a_bad_section(write_config, old, new, variable, key):
    """A ``host:`` written as a size is an error at its line, with or without an override of
    one of its keys (the override replaced it with a section of its own, planned on auto)."""
    text = GOOD.replace(old, new)
    text = text.replace("hostx:\n  limit: 32GiB\n  reserve: 4GiB\n  max_pinned: 75%\n", "")
    text = text.replace("devicex:\n  vram: 12GiB\n  reserve: 2GiB\n", "")
    for environ in ({}, {variable: "50%" if "PINNED" in variable else "16GB"}):
        with pytest.raises(ConfigError, match=rf":\d+: {key}: expected a mapping"):
            load_config(write_config(text), environ=environ)


def test_a_bad_override_names_the_variable(write_config):
    path = write_config(GOOD)
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ={"HOSTMEM_DEVICE_VRAM": "lots"})
    assert str(caught.value).startswith(f"HOSTMEM_DEVICE_VRAM (overrides device.vram of {path}): device.vram: ")


def test_yaml_syntax_errors_give_the_line(write_config):
    path = write_config(GOOD.replace("  vram: 12GiB\n", "  vram: [12GiB\n"))
    with pytest.raises(ConfigError, match=rf"^{path}:\d+: not valid YAML"):
        load_config(path, environ={})


def test_a_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize("what", ["device", "fifo", "large file"])
def test_a_config_path_that_is_no_config_is_refused_before_it_is_read(tmp_path, what):
    """``/dev/zero`` was read whole (the kernel's OOM killer ended the process), a FIFO waited
    for a writer forever, and a large file named by mistake was read whole too."""
    import subprocess
    import sys

    if what == "device":
        path = "/dev/zero"
    elif what == "fifo":
        path = os.fspath(tmp_path / "deploy.yaml")
        os.mkfifo(path)
    else:
        path = os.fspath(tmp_path / "model.safetensors")
        with open(path, "wb") as handle:
            handle.truncate(64 << 20)
    done = subprocess.run([sys.executable, "-m", "planners.cli", "plan", path], capture_output=True, text=True,
                          timeout=60)
    reason = "holds 64.0 MiB, more than a deployment config does" if what == "large file" else "not a regular file"
    assert done.returncode == 2 and done.stderr.startswith(f"hostmem: error: {path}: {reason}"), done.stderr
    assert "Traceback" not in done.stderr


def test_a_component_path_that_is_a_device_is_named_at_its_line(write_config):
    text = GOOD.replace("    size: 61.7GB\n    layers: 208\n    lora_targets: 38GB\n", "    path: /dev/null\n    layers: 208\n")
    with pytest.raises(ConfigError, match=r"components\.dit\.path: /dev/null is not a regular file or folder "
                                          r"\(a FIFO, socket or device\)"):
        load_config(write_config(text), environ={})


def test_every_shipped_config_loads_and_plans_on_a_clean_clone(tmp_path, capsys):
    from planners.cli import main

    shipped = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))
    assert len(shipped) >= 3
    os.makedirs(tmp_path / "configs")  # nothing beside them: no weights, no bench output
    for path in shipped:
        clean = shutil.copy(path, tmp_path / "configs")
        config = load_config(clean, environ={})
        assert config.components and config.streamed is not None, path
        assert main(["plan", clean, "--json"]) == 0, (path, capsys.readouterr().err)


@pytest.mark.parametrize(
    "text, share, cap",
    [("1", 1.0, None), ("0.5", 0.5, None), ("0", 0.0, None), ("50%", 0.5, None), ("18GiB", None, 18 * 1024**3)],
)
def test_max_pinned_is_a_share_unless_it_has_a_unit(write_config, text, share, cap):
    config = load_config(write_config(GOOD.replace("max_pinned: 75%", f"max_pinned: {text}")), environ={})
    assert (config.host.max_pinned_fraction, config.host.max_pinned_bytes) == (share, cap)
    limit = config.host.limit
    assert config.host.max_pinned(limit) == (cap if cap is not None else int(limit * share))
    from_env = load_config(write_config(GOOD), environ={"HOSTMEM_MAX_PINNED": text})
    assert from_env.host.max_pinned(limit) == config.host.max_pinned(limit)


@pytest.mark.parametrize("text", ["2", "16", "1.5", "-1", "24000000000"])
def test_a_bare_number_above_one_is_not_a_max_pinned(write_config, text):
    path = write_config(GOOD.replace("max_pinned: 75%", f"max_pinned: {text}"))
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ={})
    message = str(caught.value)
    assert message.startswith(f"{path}:5: host.max_pinned: {text} is a number without a unit"), message
    assert "between 0 and 1" in message and "75% or 0.75" in message and "18GiB" in message
    with pytest.raises(ConfigError, match=r"^HOSTMEM_MAX_PINNED \(overrides host.max_pinned of .*\): "
                                          r"host.max_pinned: .* a number without a unit"):
        load_config(write_config(GOOD), environ={"HOSTMEM_MAX_PINNED": text})


def test_a_cache_root_on_tmpfs_is_a_warning(write_config):
    from hostmem.procfs import filesystem_of
    from planners.host_checks import cache_root_warnings

    mount = filesystem_of("/dev/shm")
    if mount is None or mount.fs_type != "tmpfs":
        pytest.skip("/dev/shm is not tmpfs here")
    text = GOOD + "lora:\n  adapters: [{path: a.safetensors}]\n  cache: {root: /dev/shm/hostmem-cache}\n"
    (warning,) = cache_root_warnings(load_config(write_config(text), environ={}))
    assert "lora.cache.root /dev/shm/hostmem-cache" in warning and ":25) is on tmpfs" in warning
    on_disk = text.replace("/dev/shm/hostmem-cache", "cache")
    assert cache_root_warnings(load_config(write_config(on_disk), environ={})) == []


def test_reserve_above_an_auto_limit_is_an_error(write_config):
    from planners.budget import read_host_limit

    config = load_config(write_config(GOOD.replace("  limit: 32GiB\n", "  limit: auto\n")),
                         environ={"HOSTMEM_HOST_RESERVE": "1TiB"})
    with pytest.raises(ConfigError, match=r"^HOSTMEM_HOST_RESERVE \(overrides host.reserve of .*\): host.reserve: "
                                          r"1.0 TiB is not below the host limit of .* \((MemTotal|cgroup)\)"):
        read_host_limit(config)


ADAPTERS = GOOD + """
lora:
  adapters:
    - path: turbo.safetensors
      strength: 0.8
      alpha: 16
      strict: false
      rslora: true
      rules:
        - {match: "^transformer_blocks_(\\\\d+)", replace: "blocks.\\\\1"}
"""


def test_adapter_entries_carry_their_overrides(write_config):
    config = load_config(write_config(ADAPTERS), environ={})
    (adapter,) = config.lora.adapters
    assert adapter.path.endswith("turbo.safetensors") and os.path.isabs(adapter.path)
    assert (adapter.strength, adapter.alpha, adapter.strict, adapter.rslora) == (0.8, 16.0, False, True)
    assert adapter.rules[0]["replace"] == "blocks.\\1"


@pytest.mark.parametrize(
    "old, new, key",
    [
        ("alpha: 16", "alpha: sixteen", "lora.adapters[0].alpha"),
        ("strict: false", "strict: maybe", "lora.adapters[0].strict"),
        ('{match: "^transformer_blocks_(\\\\d+)", replace: "blocks.\\\\1"}', '{match: "([", replace: x}',
         "lora.adapters[0].rules"),
        ("rslora: true", "rank: 4", "lora.adapters[0].rank"),
    ],
)
def test_bad_adapter_entries_name_the_key(write_config, old, new, key):
    text = ADAPTERS.replace(old, new)
    assert text != ADAPTERS
    with pytest.raises(ConfigError) as info:
        load_config(write_config(text), environ={})
    assert key in str(info.value)


@pytest.mark.parametrize("written, read", [("1e-3", 1e-3), ("5E-1", 0.5), ("-2e0", -2.0), ("1.0e-3", 1e-3),
                                           (".5e1", 5.0), ("1E+2", 100.0)])
def test_a_strength_with_an_exponent_is_the_number_json_and_yaml_1_2_read(write_config, written, read):
    """PyYAML (YAML 1.1) leaves ``1e-3`` a string; the config reads it as the number it is."""
    config = load_config(write_config(ADAPTERS.replace("strength: 0.8", f"strength: {written}")), environ={})
    assert config.lora.adapters[0].strength == read


def test_a_name_or_path_written_like_an_exponent_stays_the_string_it_is(write_config, tmp_path):
    """Only the number readers read ``1e5`` as a number: a deployment or an adapter file so
    named is that name."""
    (tmp_path / "1e5").write_bytes(b"")
    config = load_config(write_config(ADAPTERS.replace("deployment: test", "deployment: 1e5").replace(
        "path: turbo.safetensors", "path: 1e5")), environ={})
    assert config.deployment == "1e5" and config.lora.adapters[0].path == os.fspath(tmp_path / "1e5")


@pytest.mark.parametrize("old, new", [("strength: 0.8", "strength: 1.0e+300"), ("alpha: 16", "alpha: -1.0e+39"),
                                      ("strength: 0.8", "strength: '0.8'"), ("strength: 0.8", "strength: '1e-3'")])
def test_a_strength_or_alpha_beyond_float32_or_quoted_is_refused_at_its_line(write_config, old, new):
    with pytest.raises(ConfigError) as info:
        load_config(write_config(ADAPTERS.replace(old, new)), environ={})
    message = str(info.value)
    assert f"lora.adapters[0].{new.split(':')[0]}" in message
    assert ("float32's range" in message) != ("is not a number" in message)  # a quoted number is a string


def test_hostmem_lora_merge_builds_into_the_component_a_server_merges_into(write_config, tmp_path):
    """Two streamed experts (Wan 2.2), the LoRA declared on the second: the CLI's build and
    the server's start agree on ``merge_target``, not on the component named first."""
    from planners.commands.lora import _merge_component

    ckpt = tmp_path / "ckpt.safetensors"
    ckpt.write_bytes(b"")
    text = ("deployment: experts\nhost: {limit: 64GiB, reserve: 4GiB}\nworkload: {steps: 4}\n"
            "components:\n"
            f"  dit_high: {{path: {ckpt}, layers: \"blocks.{{{{i}}}}.\", offload: layerwise}}\n"
            f"  dit_low: {{path: {ckpt}, layers: \"blocks.{{{{i}}}}.\", lora_targets: 1GiB, offload: layerwise}}\n"
            f"lora: {{adapters: [{{path: {ckpt}}}]}}\n")
    config = load_config(write_config(text), environ={})
    assert config.merge_target.name == "dit_low" and _merge_component(config) is config.merge_target


@pytest.mark.parametrize("variable, value, words", [
    ("HOSTMEM_HOST_LIMIT", "3GiB", "is not below host.limit '3GiB' (from HOSTMEM_HOST_LIMIT)"),
    ("HOSTMEM_DEVICE_VRAM", "1GiB", "is not below device.vram '1GiB' (from HOSTMEM_DEVICE_VRAM)"),
])
def test_a_value_from_the_environment_that_clashes_with_the_file_names_its_variable(write_config, variable, value,
                                                                                    words):
    """The message named only the file, which says 32GiB: the variable that set 3GiB went unnamed."""
    with pytest.raises(ConfigError) as caught:
        load_config(write_config(GOOD), environ={variable: value})
    assert words in str(caught.value), str(caught.value)
