"""An adapter's meaning (the key's identity of it: lora_cache.key.combination) is recorded in
every root a process builds in, not only the first."""

from __future__ import annotations

import os

import pytest

import lora_cache
from tests.lora_cache.test_rounding import adapter, base_model


def test_a_process_that_starts_on_a_second_root_records_the_adapters_meaning_there_too(tmp_path):
    path, _ = adapter(tmp_path)
    for name in ("first", "second"):
        os.makedirs(tmp_path / name)
        model = base_model(tmp_path / name)
        with pytest.warns(UserWarning, match="kept at run time"):
            lora_cache.merge(model, [path], cache_root=tmp_path / name / "cache", progress=False)
        assert lora_cache.wait_sealed(timeout=60)
        records = os.listdir(tmp_path / name / "cache" / "lora_merge_cache" / "conversions")
        assert [r for r in records if r.startswith("meaning-")], (name, records)
