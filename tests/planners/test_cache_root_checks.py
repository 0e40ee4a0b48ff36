"""`hostmem plan` warns where the LoRA cache will not work, before a start finds out: the
warnings name the root and its line, and each problem root is one the vault refuses."""

from __future__ import annotations

import os

import pytest

from hostmem.vault import VaultError
from hostmem.vault.safety import prepare_root
from planners.config import load_config
from planners.host_checks import cache_root_warnings
from tests.planners.test_config import GOOD


def _config(write_config, roots: list[str]):
    cache = f"root: {roots[0]}" if len(roots) == 1 else f"roots: [{', '.join(roots)}]"
    text = GOOD + f"lora:\n  adapters: [{{path: a.safetensors}}]\n  cache: {{{cache}}}\n"
    return load_config(write_config(text), environ={})


def _cache_line(config) -> int:
    """The line of ``cache:`` in the config file written."""
    with open(config.origin.path) as handle:
        return next(n for n, line in enumerate(handle, 1) if line.lstrip().startswith("cache:"))


def _problem_roots(tmp_path) -> dict[str, str]:
    """Roots a merge cannot use, each with what its warning says."""
    (tmp_path / "a-file").write_text("not a folder")
    shared = tmp_path / "everyone"
    shared.mkdir()
    os.chmod(shared, 0o777)  # others may write: they could swap a cached weight
    return {
        os.fspath(tmp_path / "a-file"): "exists and is not a folder",
        os.fspath(tmp_path / "a-file" / "cache"): f"cannot be created: {tmp_path / 'a-file'} is a file",
        "/proc/hostmem-cache": "kernel's proc filesystem",
        os.fspath(shared): "writable by every user",
    }


def test_each_root_the_vault_refuses_is_a_warning_naming_it_and_its_line(write_config, tmp_path):
    for root, says in _problem_roots(tmp_path).items():
        with pytest.raises(VaultError):
            prepare_root(root)  # what a merge at this root meets
        config = _config(write_config, [root])
        (warning,) = cache_root_warnings(config)
        assert warning.startswith(f"lora.cache.root {root} (") and f":{_cache_line(config)})" in warning, warning
        assert says in warning and "every merge there fails" in warning, warning


def test_a_good_root_beside_a_bad_one_warns_of_the_bad_one_only(write_config, tmp_path):
    bad = tmp_path / "a-file"
    bad.write_text("x")
    good = tmp_path / "cache"
    (warning,) = cache_root_warnings(_config(write_config, [os.fspath(bad), os.fspath(good)]))
    assert warning.startswith(f"lora.cache.roots {bad} (") and "exists and is not a folder" in warning
    assert cache_root_warnings(_config(write_config, [os.fspath(good)])) == []
    assert not good.exists()  # a plan creates nothing


def test_read_only_roots_alone_warn_that_a_miss_merges_in_place(write_config, tmp_path, read_only_copy):
    (tmp_path / "image").mkdir()
    baked = read_only_copy(os.fspath(tmp_path / "image"))
    (warning,) = cache_root_warnings(_config(write_config, [baked]))
    assert "no root can take a build" in warning and "merges in place" in warning, warning
    assert cache_root_warnings(_config(write_config, [baked, os.fspath(tmp_path / "local")])) == []


def test_plan_prints_the_warning_and_still_plans(write_config, tmp_path, capsys):
    from planners.cli import main

    (tmp_path / "a-file").write_text("x")
    text = GOOD + f"lora:\n  adapters: [{{path: a.safetensors}}]\n  cache: {{root: {tmp_path / 'a-file'}}}\n"
    assert main(["plan", write_config(text)]) == 0
    out = capsys.readouterr().out
    assert f"lora.cache.root {tmp_path / 'a-file'}" in out and "exists and is not a folder" in out, out
    assert "warnings: none" not in out
