"""A component already on the device when the plan is made holds device memory there.

A server moves its text encoder to the GPU itself (``pipe.text_encoder.to("cuda")``)
before planning; its parameters then are no host memory, and the plan counted them as
nothing: it gave their room to resident DiT blocks and said "fits" on a device they
overfill. The meta device stands in for the GPU here: its tensors are on a device, not
the CPU, as a CUDA tensor is (the accountant tells their storages apart).
"""

from __future__ import annotations

import hostmem
from planners.config import parse_config
from planners.startup import plan_loaded

from .conftest import MiB, mapped_module, write_checkpoint

CONFIG = """
deployment: held-on-the-device
host: {limit: 3GiB, reserve: 600MiB, max_pinned: 100%}
device: {vram: 100MiB, reserve: 20MiB}
workload: {steps: 4}
components:
  dit: {path: dit, layers: "blocks.{i}.", offload: layerwise}
  text_encoder: {path: te, layers: "enc.{i}.", offload: none}
"""


def test_a_text_encoder_moved_to_the_device_first_is_planned_as_held_there(tmp_path):
    write_checkpoint(tmp_path / "dit", 12, 4 * MiB)
    write_checkpoint(tmp_path / "te", 8, 4 * MiB, prefix="enc")
    config = parse_config(CONFIG, str(tmp_path / "deploy.yaml"), environ={})
    dit = mapped_module(tmp_path / "dit")
    on_host = plan_loaded(config, {"dit": dit, "text_encoder": mapped_module(tmp_path / "te")}, quiet=True)
    moved = mapped_module(tmp_path / "te").to("meta")  # as pipe.text_encoder.to("cuda") leaves it
    assert hostmem.account({"te": moved}).components["te"].device_bytes == 32 * MiB  # 8 storages, not one
    on_device = plan_loaded(config, {"dit": dit, "text_encoder": moved}, quiet=True)
    for plan in (on_host, on_device):
        assert dict(plan.device.held) == {"text_encoder": 32 * MiB}
        assert plan.device.peak_bytes <= 100 * MiB
    assert on_device.device.part("dit").resident_layers == on_host.device.part("dit").resident_layers
    assert on_device.device.peak_bytes == on_host.device.peak_bytes
