"""``transfer: measured``: the plan prices transfers at the rates of the last ``hostmem calibrate --save``.

A real calibration of a real folder is saved in the user's cache root; a config that
says ``transfer: measured`` then plans with those rates, and the report (text and JSON
alike) names the record. Without a record the defaults stand, and the report says so.
"""

from __future__ import annotations

import json
import os

import pytest

from planners.cli import main
from planners.config import ConfigError, load_config
from planners.config.model import TransferConfig
from planners.calibration import RECORD

CONFIG = ("deployment: rates\nhost: {limit: 64GiB, reserve: 4GiB}\nworkload: {steps: 4}\n"
          "components:\n  dit: {size: 8GiB, layers: 16, offload: layerwise}\n")


@pytest.fixture
def root(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("HOSTMEM_CACHE_ROOT", str(folder))
    return folder


def _write(tmp_path, transfer: str) -> str:
    path = tmp_path / "deploy.yaml"
    path.write_text(CONFIG + transfer)
    return str(path)


def _plan(capsys, config: str) -> tuple[str, dict]:
    assert main(["plan", config]) == 0
    text = capsys.readouterr().out
    assert main(["plan", config, "--json"]) == 0
    return text, json.loads(capsys.readouterr().out)


def test_saved_calibration_is_what_a_measured_config_plans_with(tmp_path, root, capsys):
    folder = tmp_path / "disk"
    folder.mkdir()
    assert main(["calibrate", "--path", str(folder), "--root", str(root), "--size", "8MiB", "--save", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    saved = root / RECORD
    assert result["saved"] == str(saved) and saved.is_file() and (saved.stat().st_mode & 0o077) == 0
    measured = result["transfer"]["disk_read"]
    assert measured != TransferConfig().disk_read
    config = _write(tmp_path, "transfer: measured\n")
    assert load_config(config).transfer.disk_read == measured
    text, report = _plan(capsys, config)
    rates = report["transfer"]
    assert rates["disk_read"] == measured and str(saved) in rates["source"]
    assert rates["source"].startswith("measured by hostmem calibrate at ")
    (line,) = [line for line in text.splitlines() if line.startswith("transfer rates:")]
    assert rates["source"] in line  # the text names the same record as the JSON
    if "pinned_h2d" not in result["transfer"]:  # no GPU: the device rates stay the defaults, said so
        assert rates["pinned_h2d"] == TransferConfig().pinned_h2d and "measured without a GPU" in line


def test_without_a_saved_calibration_the_defaults_stand_and_the_report_says_so(tmp_path, root, capsys):
    text, report = _plan(capsys, _write(tmp_path, "transfer: measured\n"))
    default = TransferConfig()
    assert report["transfer"]["disk_read"] == default.disk_read
    assert "no calibration saved" in report["transfer"]["source"] and "hostmem calibrate --save" in text
    text, report = _plan(capsys, _write(tmp_path, "transfer: {disk_read: 1GB/s}\n"))
    assert report["transfer"]["disk_read"] == 1e9 and report["transfer"]["source"] == "config"
    assert "the config's transfer: block" in text


def test_a_record_not_a_calibration_is_not_used(tmp_path, root, capsys):
    root.mkdir(mode=0o700)
    (root / RECORD).write_text(json.dumps({"format": "hostmem-calibration/1", "transfer": {"disk_read": 3}}))
    assert load_config(_write(tmp_path, "transfer: measured\n")).transfer.disk_read == TransferConfig().disk_read


def test_transfer_with_another_word_is_refused_naming_the_choices(tmp_path, root):
    with pytest.raises(ConfigError, match="write measured"):
        load_config(_write(tmp_path, "transfer: measure\n"))


def test_calibrate_saves_where_the_plan_reads_with_xdg_cache_home_set(tmp_path, monkeypatch):
    """No --root, no config root, no HOSTMEM_CACHE_ROOT: ``hostmem calibrate --save`` and a
    plan with ``transfer: measured`` both take ``$XDG_CACHE_HOME/hostmem``."""
    import argparse

    from planners.calibration import record_path
    from planners.commands.calibrate import cache_root

    monkeypatch.delenv("HOSTMEM_CACHE_ROOT", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    saved = os.path.join(cache_root(argparse.Namespace(root=None), None), "calibration.json")
    assert saved == record_path() == str(tmp_path / "xdg" / "hostmem" / "calibration.json")
