"""Records are checked whoever wrote them, and one that cannot be used or written says why.

A reserve record with a string where bytes go, a calibration of infinite rates, a record
another user (``nobody``, for real) planted, a rounding record with nowhere to go: each
is a plan or a start that goes on with the defaults and one line naming the file and
the reason, never a traceback and never "inf EiB/s".
"""

from __future__ import annotations

import json
import os

from hostmem.vault import Vault
from hostmem.vault.records import ROUNDING
from hostmem.vault.shelf import Shelf
from planners.calibration import describe, read_calibration, record_path
from planners.reserve import record_path as reserve_path
from tests.planners.test_measured_reserve import deployment, one_request  # noqa: F401 (a fixture)

from .users import as_nobody, nobody, reachable_by_others


def _write_json(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    with open(path, "w") as handle:
        handle.write(text)


def test_a_reserve_record_with_a_string_for_its_bytes_is_named_and_the_floor_stands(deployment):  # noqa: F811
    from planners.reserve import measure_reserve

    write, _, _ = deployment
    config, _ = measure_reserve(write("measured"), one_request)
    path = reserve_path(config)
    data = json.load(open(path))
    data["growth_bytes"] = "x"
    _write_json(path, json.dumps(data))
    again = write("measured")  # the plan resolves the reserve here
    assert again.host.reserve == again.host.reserve_floor
    assert path in again.host.reserve_source and "growth_bytes" in again.host.reserve_source


def _calibration(rates: dict) -> str:
    return json.dumps({"format": "hostmem-calibration/1", "measured_at": "2026-01-01T00:00:00+00:00",
                       "transfer": rates})


def _measured_config(tmp_path):
    from planners.config import load_config
    from tests.planners.test_config import GOOD

    path = tmp_path / "deploy.yaml"
    text = GOOD.replace("transfer:\n  pinned_h2d: 24GB/s\n", "transfer: measured\n")
    path.write_text(text + f"lora:\n  adapters: [{{path: a.safetensors}}]\n  cache: {{root: {tmp_path / 'cache'}}}\n")
    return load_config(path, environ={})


def test_infinite_calibration_rates_are_refused_by_name_not_printed_as_inf(tmp_path):
    config = _measured_config(tmp_path)
    path = record_path(config)
    _write_json(path, _calibration({"disk_read": float("inf"), "pinned_h2d": 2e10}))
    assert json.load(open(path))["transfer"]["disk_read"] == float("inf")  # as JSON's Infinity
    record, why = read_calibration(path)
    assert record is None and "disk_read=inf" in why and path in why
    shown = describe(_measured_config(tmp_path).transfer)  # the plan's line
    assert "inf EiB/s" not in shown and "disk_read=inf" in shown


def test_a_calibration_another_user_planted_says_why_it_is_not_used(tmp_path):
    uid = nobody()[0]
    config = _measured_config(tmp_path)
    path = record_path(config)
    folder = os.path.dirname(path)
    os.makedirs(folder, mode=0o777)
    os.chmod(folder, 0o777)
    with reachable_by_others(folder):
        as_nobody(_write_json, path, _calibration({"disk_read": 5e9}))
    resolved = _measured_config(tmp_path)
    assert f"not a file of this user's (uid {uid})" in resolved.transfer.source
    assert "no calibration saved" not in resolved.transfer.source


def test_a_rounding_record_that_cannot_be_written_is_named(tmp_path, capfd):
    vault = Vault(str(tmp_path / "root"))
    with open(os.path.join(vault.cache, ROUNDING), "w") as handle:
        handle.write("a file where the records' folder goes")  # as a full disk, the write fails
    assert Shelf([vault], ROUNDING).store("k" * 64, {"lost": {}}) is False
    said = capfd.readouterr().err
    assert os.path.join(vault.cache, ROUNDING, "k" * 64 + ".json") in said and "record not written" in said
