"""The kernel choice: timed on the machine, remembered under the cache root, named by the key."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import lora_cache
from lora_cache.kernels import WISDOM_FILE, machine, measure_kernels, plan_kernels, shape_class, worker_count
from lora_cache.kernels.wisdom import entry_key
from lora_cache.placement.layers import checkpoint_module
from lora_cache.compute.merge_math import BF16_ADDMM, FP32_ROWS, Delta, Scratch, merged_weight, one_pass_applies
from tests.conftest import run_python, write_safetensors
from tests.fresh_fork import TORCH
from tests.lora_cache.test_adapters import lora_change, write_adapter

CPU = torch.device("cpu")
ROWS, COLS, RANK = 1024, 768, 8


def _bf16(change: dict) -> dict:
    return {k: v.to(torch.bfloat16) for k, v in change.items()}


def _model_files(folder) -> tuple[str, str]:
    """A bf16 checkpoint of three layers and a bf16 rank-8 adapter on each: the case with a choice."""
    gen = torch.Generator().manual_seed(4)
    names = [f"blocks.{i}.proj" for i in range(3)]
    base = write_safetensors(folder / "base.safetensors", {
        f"{n}.weight": torch.randn(ROWS, COLS, generator=gen).to(torch.bfloat16) for n in names})
    changes = {n: _bf16(lora_change(ROWS, COLS, RANK, i, alpha=4)) for i, n in enumerate(names)}
    return base, write_adapter(folder / "a.safetensors", "comfyui", changes)


def _plant(root, kernel: str) -> str:
    """A wisdom file under ``root`` that says ``kernel`` is the fastest for the test's layers."""
    delta = Delta("x", torch.zeros(ROWS, RANK, dtype=torch.bfloat16), torch.zeros(RANK, COLS, dtype=torch.bfloat16))
    cls = shape_class((ROWS, COLS), torch.bfloat16, [delta], CPU)
    os.makedirs(root, exist_ok=True)
    entry = {"kernel": kernel, "seconds_per_gib": {BF16_ADDMM: 1.0, FP32_ROWS: 1.0}}
    with open(os.path.join(root, WISDOM_FILE), "w") as handle:
        json.dump({"version": 1, "entries": {entry_key("bfloat16", cls, worker_count()): entry}}, handle)
    return cls


def test_only_a_bf16_base_with_one_bf16_lora_on_the_cpu_has_a_choice():
    up, down = torch.zeros(64, 4, dtype=torch.bfloat16), torch.zeros(4, 96, dtype=torch.bfloat16)
    lora = Delta("a", up, down)
    assert shape_class((64, 96), torch.bfloat16, [lora], CPU) == "bf16-lora/cols128/rank4"
    assert shape_class((64, 100), torch.bfloat16, [lora], CPU) == "bf16-lora/cols128/rank4"  # one class per width
    assert shape_class((64, 96), torch.float16, [lora], CPU) is None
    assert shape_class((64, 96), torch.bfloat16, [lora, lora], CPU) is None  # two adapters: fp32, one rounding
    assert shape_class((64, 96), torch.bfloat16, [Delta("a", up.float(), down.float())], CPU) is None
    assert shape_class((64, 96), torch.bfloat16, [lora], torch.device("meta")) is None  # off the CPU: the device's own
    assert one_pass_applies(torch.bfloat16, 2, [lora], CPU) and not one_pass_applies(torch.bfloat16, 1, [lora], CPU)


def test_measuring_times_both_kernels_and_picks_the_faster():
    entry = measure_kernels(ROWS, COLS, RANK)
    seconds = entry["seconds_per_gib"]
    assert set(seconds) == {BF16_ADDMM, FP32_ROWS} and all(0 < s < 1e4 for s in seconds.values())
    assert entry["kernel"] == min(seconds, key=seconds.get)


def test_the_choice_is_timed_once_and_remembered_under_the_root(tmp_path):
    base, adapter = _model_files(tmp_path)
    layers = [((ROWS, COLS), torch.bfloat16, [Delta("a", *(_bf16(lora_change(ROWS, COLS, RANK, 0))[k]
                                                         for k in ("up", "down")))])]
    plan = plan_kernels(layers, CPU, tmp_path / "root")
    (cls, kernel), = plan.choices
    saved = json.loads((tmp_path / "root" / WISDOM_FILE).read_text())
    (key, entry), = saved["entries"].items()
    description = json.loads(key)
    assert description == [machine()["cpu"], machine()["flags"], torch.__version__, "bfloat16", cls, worker_count()]
    assert entry["kernel"] == kernel and set(entry["seconds_per_gib"]) == {BF16_ADDMM, FP32_ROWS}
    other = FP32_ROWS if kernel == BF16_ADDMM else BF16_ADDMM
    _plant(tmp_path / "root", other)  # what the file says stands: no timing overrides it
    assert plan_kernels(layers, CPU, tmp_path / "root").choices == ((cls, other),)
    assert not [f for f in os.listdir(tmp_path / "root") if f.endswith(".tmp")]


def test_an_unreadable_wisdom_file_is_timed_again_and_replaced(tmp_path):
    (tmp_path / WISDOM_FILE).write_text("{not json")
    layers = [((ROWS, COLS), torch.bfloat16, [Delta("a", torch.zeros(ROWS, RANK, dtype=torch.bfloat16),
                                                   torch.zeros(RANK, COLS, dtype=torch.bfloat16))])]
    with pytest.warns(UserWarning, match=f"{WISDOM_FILE}: unreadable kernel wisdom .*Delete the file"):
        plan = plan_kernels(layers, CPU, tmp_path)
    assert len(plan.choices) == 1
    assert len(json.loads((tmp_path / WISDOM_FILE).read_text())["entries"]) == 1


@pytest.mark.parametrize("kernel", [BF16_ADDMM, FP32_ROWS])
def test_the_key_names_the_kernel_and_the_cache_holds_that_kernels_bytes(tmp_path, kernel):
    """Whichever kernel the machine's wisdom picks, the cache key says so and the cached bytes
    are exactly what that kernel computes (compared bit for bit)."""
    base, adapter = _model_files(tmp_path)
    cls = _plant(tmp_path / "cache", kernel)
    model = checkpoint_module([base])
    originals = {n: p.detach() for n, p in model.named_parameters()}
    stats = lora_cache.merge(model, [adapter], cache_root=tmp_path / "cache", device="cpu", progress=False)
    assert stats.built == 3
    manifest = json.loads((tmp_path / "cache" / "lora_merge_cache" / stats.cache_key / "manifest.json").read_text())
    assert manifest["inputs"]["merge_policy"].endswith(f"@cpu+{cls}={kernel}")
    changes = {f"blocks.{i}.proj": _bf16(lora_change(ROWS, COLS, RANK, i, alpha=4)) for i in range(3)}
    for name, weight in model.named_parameters():
        change = changes[name.removesuffix(".weight")]
        delta = Delta("a", change["up"], change["down"], 4 / RANK)
        expected = merged_weight(originals[name], [delta], torch.empty_like(weight), Scratch("cpu"), kernel=kernel)
        assert torch.equal(weight.view(torch.int16), expected.view(torch.int16)), name


def test_a_different_choice_is_a_different_combination(tmp_path):
    base, adapter = _model_files(tmp_path)
    keys = []
    for kernel in (BF16_ADDMM, FP32_ROWS):
        _plant(tmp_path / kernel, kernel)
        model = checkpoint_module([base])
        keys.append(lora_cache.merge(model, [adapter], cache_root=tmp_path / kernel, device="cpu",
                                     progress=False).cache_key)
    assert keys[0] != keys[1]


_PLAN = r"""
import sys, torch
from lora_cache.kernels import plan_kernels
from lora_cache.compute.merge_math import Delta
layer = ((1024, 768), torch.bfloat16, [Delta("a", torch.zeros(1024, 8, dtype=torch.bfloat16),
                                             torch.zeros(8, 768, dtype=torch.bfloat16))])
print(plan_kernels([layer], "cpu", sys.argv[1]).describe())
"""


def test_processes_that_time_at_once_agree(tmp_path):
    """The first to record wins; the others read its choice under the lock, so every process
    (and so every key) on the machine names the same kernel."""
    import subprocess
    import sys

    command = [sys.executable, "-c", _PLAN, str(tmp_path)]
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outputs = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(outputs) == 1 and outputs.pop().startswith("bf16-lora/cols1024/rank8=")
    assert run_python(_PLAN, str(tmp_path), forked_from=TORCH).stdout.strip() == \
        f"bf16-lora/cols1024/rank8={json.loads((tmp_path / WISDOM_FILE).read_text())['entries'].popitem()[1]['kernel']}"


_READ_ONLY_PLAN = r"""
import sys, torch
from lora_cache.kernels import plan_kernels
from lora_cache.compute.merge_math import Delta
def layer(cols):
    return ((1024, cols), torch.bfloat16, [Delta("a", torch.zeros(1024, 8, dtype=torch.bfloat16),
                                                torch.zeros(8, cols, dtype=torch.bfloat16))])
print(plan_kernels([layer(768), layer(3 * 768)], "cpu", sys.argv[1]).describe())
"""


def test_a_root_that_cannot_be_written_is_read_and_its_new_choices_stay_in_the_process(tmp_path):
    """A cache image mounted read-only (here: a folder of mode 0500, for a process without
    the capability to override it): the wisdom it carries is used, the rest is timed and
    kept in the process, and nothing is written."""
    import shutil

    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv is not installed")
    cls = _plant(tmp_path / "image", FP32_ROWS)
    os.chmod(tmp_path / "image", 0o500)
    drop = "-dac_override,-dac_read_search,-fowner"
    try:
        import subprocess
        import sys

        done = subprocess.run([setpriv, f"--inh-caps={drop}", f"--bounding-set={drop}", sys.executable, "-c",
                               _READ_ONLY_PLAN, str(tmp_path / "image")], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        choices = dict(part.split("=") for part in done.stdout.strip().split(";"))
        assert choices[cls] == FP32_ROWS and len(choices) == 2
        assert sorted(os.listdir(tmp_path / "image")) == [WISDOM_FILE]
    finally:
        os.chmod(tmp_path / "image", 0o700)


_PLAN_AND_COUNT = r"""
import sys, torch
from lora_cache.kernels import plan_kernels
from lora_cache.compute.merge_math import Delta, _bf16_addmm_rounds_once
layer = ((1024, 768), torch.bfloat16, [Delta("a", torch.zeros(1024, 8, dtype=torch.bfloat16),
                                             torch.zeros(8, 768, dtype=torch.bfloat16))])
print(plan_kernels([layer], "cpu", sys.argv[1]).describe(), _bf16_addmm_rounds_once.cache_info().currsize)
"""


def test_how_bf16_addmm_rounds_is_learned_once_and_read_back_by_later_starts(tmp_path):
    """A process's first bf16 addmm costs milliseconds: the first plan on a machine asks it
    and the wisdom keeps the answer, so a later start plans without any bf16 addmm."""
    from lora_cache.kernels.plan import ROUNDS_ONCE
    from lora_cache.kernels.wisdom import FACTS
    from lora_cache.compute.merge_math import _bf16_addmm_rounds_once

    first = run_python(_PLAN_AND_COUNT, str(tmp_path), forked_from=TORCH)
    assert first.returncode == 0, first.stderr
    plan, asked = first.stdout.split()
    assert asked == "1"
    facts = json.loads((tmp_path / WISDOM_FILE).read_text())[FACTS]
    assert facts == {entry_key("bfloat16", ROUNDS_ONCE, worker_count()): {"rounds_once": _bf16_addmm_rounds_once()}}
    later = run_python(_PLAN_AND_COUNT, str(tmp_path), forked_from=TORCH)
    assert later.returncode == 0, later.stderr
    assert later.stdout.split() == [plan, "0"]


def test_where_bf16_addmm_does_not_round_once_every_layer_is_summed_in_fp32(tmp_path):
    """The fact as a machine whose addmm rounds the product first would have recorded it:
    no class has a choice, whatever the timings say, and the key names no kernel."""
    from lora_cache.kernels.plan import ROUNDS_ONCE
    from lora_cache.kernels.wisdom import FACTS

    cls = _plant(tmp_path, BF16_ADDMM)
    saved = json.loads((tmp_path / WISDOM_FILE).read_text())
    saved[FACTS] = {entry_key("bfloat16", ROUNDS_ONCE, worker_count()): {"rounds_once": False}}
    (tmp_path / WISDOM_FILE).write_text(json.dumps(saved))
    delta = Delta("x", torch.zeros(ROWS, RANK, dtype=torch.bfloat16), torch.zeros(RANK, COLS, dtype=torch.bfloat16))
    plan = plan_kernels([((ROWS, COLS), torch.bfloat16, [delta])], CPU, tmp_path)
    assert cls is not None and plan.choices == () and plan.describe() == ""
    assert plan.kernel_for((ROWS, COLS), torch.bfloat16, [delta], CPU) == FP32_ROWS


def _openmp():
    """The OpenMP runtime torch runs on (libgomp beside it), or None."""
    import ctypes
    import glob

    found = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")))
    return ctypes.CDLL(found[0]) if found else None


def test_each_block_worker_runs_torch_on_one_thread_of_openmp():
    from lora_cache.kernels import block_workers

    openmp = _openmp()
    if openmp is None:
        pytest.skip("torch here runs on no libgomp of its own")
    with ThreadPoolExecutor(1) as plain:
        if plain.submit(openmp.omp_get_max_threads).result() < 2:
            pytest.skip("a new thread's OpenMP default is one thread here (one CPU, or OMP_NUM_THREADS=1)")
    with block_workers(torch.device("cpu")) as workers:
        counts = list(workers.map(lambda _: openmp.omp_get_max_threads(), range(4 * workers.threads)))
    assert counts == [1] * len(counts)  # oneDNN's bf16 product starts no team of spinning threads
