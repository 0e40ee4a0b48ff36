"""Config of a deployment's shape: several streamed components, experts that take turns, ranks."""

from __future__ import annotations

import pytest

from hostmem.errors import InputError
from planners.config import ConfigError, load_config
from planners.config.parallel import with_ranks

BASE = """
deployment: wan22
host: {limit: 64GiB, reserve: 4GiB}
device: {vram: 48GB, reserve: 2GB}
workload: {steps: 40, passes_per_step: 2}
components:
  dit_high: {size: 28GB, layers: 40, offload: layerwise, steps: 20}
  dit_low: {size: 28GB, layers: 40, offload: layerwise, steps: 20}
  text_encoder: {size: 11GB, layers: 24, offload: full}
"""


def test_experts_that_take_turns_each_move_their_share_of_the_passes(write_config):
    config = load_config(write_config(BASE), environ={})
    assert [c.name for c in config.streamed_components] == ["dit_high", "dit_low"]
    assert config.alternating() == ("dit_high", "dit_low")
    assert config.moves("dit_high") == 20 * 2 and config.moves("text_encoder") == 1


def test_two_streamed_components_without_steps_each_run_every_step(write_config):
    config = load_config(write_config(BASE.replace(", steps: 20", "")), environ={})
    assert config.alternating() == () and config.moves("dit_low") == 80


LOW = "dit_low: {size: 28GB, layers: 40, offload: layerwise, steps: 20}"
TE = "text_encoder: {size: 11GB, layers: 24, offload: full}"


@pytest.mark.parametrize("old, new, where, said", [
    (LOW, LOW.replace("20", "30"), ":7: components.dit_low.steps",
     "(dit_high 20 + dit_low 30 = 50) do not add up to workload.steps (40)"),
    (LOW, LOW.replace(", steps: 20", ""), ":6: components.dit_high.steps", "only one component runs a share"),
    (TE, TE.replace("}", ", steps: 1}"), ":8: components.text_encoder.steps",
     "only a streamed component (offload: layerwise) runs a share"),
])
def test_steps_that_do_not_describe_turns_are_refused_at_their_line(write_config, old, new, where, said):
    with pytest.raises(ConfigError) as caught:
        load_config(write_config(BASE.replace(old, new)), environ={})
    assert where in str(caught.value) and said in str(caught.value)


QWEN = """
deployment: qwen-image-tp4
host: {limit: 128GiB, reserve: 6GiB}
device: {vram: 80GB, reserve: 4GB}
workload: {steps: 50, passes_per_step: 2}
parallel: {ranks: 4, tensor_parallel: 4}
components:
  dit: {size: 40.9GB, layers: 60, offload: layerwise}
  text_encoder: {size: 16.6GB, layers: 28, offload: full}
"""


def test_parallel_splits_the_streamed_components_by_default(write_config):
    config = load_config(write_config(QWEN), environ={})
    assert config.parallel.ranks == 4 and config.parallel.tensor_parallel == 4 and config.parallel.split == ("dit",)
    assert config.parallel.source == "config"


@pytest.mark.parametrize("parallel, said", [
    ("{ranks: 4, tensor_parallel: 3}", "parallel.tensor_parallel: 3 does not divide parallel.ranks (4)"),
    ("{ranks: 4, tensor_parallel: 4, split: [vae]}", "parallel.split: vae is not a component"),
    ("{ranks: 2, split: [dit]}", "nothing is split without tensor_parallel above 1"),
    ("{ranks: 0}", "parallel.ranks: 0 is not a whole number from 1"),
    ("{rank: 4}", "parallel.rank: unknown key; did you mean 'ranks'?"),
])
def test_a_parallel_section_that_cannot_be_is_refused(write_config, parallel, said):
    with pytest.raises(ConfigError, match=":5: ") as caught:
        load_config(write_config(QWEN.replace("{ranks: 4, tensor_parallel: 4}", parallel)), environ={})
    assert said in str(caught.value)


def test_ranks_come_from_the_command_line_then_torchrun_then_the_config(write_config):
    parallel = load_config(write_config(QWEN), environ={}).parallel
    assert with_ranks(parallel, 8, {}).ranks == 8 and with_ranks(parallel, 8, {}).source == "--ranks"
    torchrun = with_ranks(parallel, None, {"LOCAL_WORLD_SIZE": "8", "LOCAL_RANK": "3"})
    assert (torchrun.ranks, torchrun.local_rank, torchrun.source) == (8, 3, "LOCAL_WORLD_SIZE")
    assert with_ranks(parallel, None, {}) == parallel
    with pytest.raises(InputError, match="6 ranks .--ranks. are not a multiple of parallel.tensor_parallel .4."):
        with_ranks(parallel, 6, {})
    with pytest.raises(InputError, match="LOCAL_RANK=4 is not within LOCAL_WORLD_SIZE=4"):
        with_ranks(parallel, None, {"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "4"})
