"""How the demo writes its files: O_DIRECT through a staging buffer, read back, and the
way chosen by measuring both on the machine."""

from __future__ import annotations

import os

import pytest
import torch

from hostmem.safetensors.mapping import load_readonly, save_file
from hostmem import file_writes
from hostmem.write_way import WAYS, WayChoice, measure, read_back
from tests.page_cache import cached_pages

MiB = 1024 * 1024


def _tensors() -> dict[str, torch.Tensor]:
    """Sizes that leave the header, every tensor and the file's end off page boundaries."""
    gen = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(333, 517, generator=gen).to(torch.bfloat16),
        "b.bias": torch.randn(7, generator=gen),
        "c.weight": torch.randint(-128, 127, (3 * MiB + 5,), generator=gen, dtype=torch.int8),
    }


def _folders(tmp_path) -> list[str]:
    """The temp folder, and tmpfs (which refuses O_DIRECT) where the machine has it."""
    folders = [str(tmp_path)]
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        folders.append("/dev/shm")
    return folders


@pytest.mark.parametrize("stage_mib", [64, 1], ids=["one-stage", "many-stages"])
def test_a_direct_save_writes_the_bytes_a_buffered_save_writes(tmp_path, monkeypatch, stage_mib):
    monkeypatch.setattr(file_writes, "_STAGE", stage_mib * MiB)  # 1 MiB: the 3 MiB tensor spans stages
    tensors = _tensors()
    for folder in _folders(tmp_path):
        buffered, direct = (os.path.join(folder, f".hostmem-test-{os.getpid()}-{w}.safetensors") for w in WAYS)
        try:
            assert save_file(tensors, buffered) == save_file(tensors, direct, direct=True, fsync=True)
            with open(buffered, "rb") as a, open(direct, "rb") as b:
                assert a.read() == b.read(), folder
            loaded = load_readonly(direct)
            assert all(torch.equal(loaded[name], t) for name, t in tensors.items())
        finally:
            for path in (buffered, direct):
                if os.path.exists(path):
                    os.unlink(path)


def test_a_direct_save_read_back_is_in_the_page_cache(tmp_path):
    path = str(tmp_path / "direct.safetensors")
    save_file(_tensors(), path, direct=True, fsync=True)
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # whatever the write left cached goes
    os.close(fd)
    if all(cached_pages(path)):
        pytest.skip("this filesystem keeps the file cached after DONTNEED (tmpfs): nothing to read back")
    read_back(path)
    assert all(cached_pages(path))


def test_measuring_times_both_ways_picks_the_faster_and_leaves_nothing(tmp_path):
    choice = measure(str(tmp_path), nbytes=4 * MiB)
    assert set(choice.seconds_per_gib) == set(WAYS) and all(v > 0 for v in choice.seconds_per_gib.values())
    assert choice.seconds_per_gib[choice.faster] == min(choice.seconds_per_gib.values())
    assert os.listdir(tmp_path) == []  # the trial files are gone
    assert WayChoice({"buffered": 5.0, "direct": 1.0}).faster == "direct"
    assert WayChoice({"buffered": 0.5, "direct": 1.1}).faster == "buffered"
