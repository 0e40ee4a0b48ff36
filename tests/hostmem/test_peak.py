"""The peak tracker against the kernel's own counters: real allocations, real /proc."""

from __future__ import annotations

import json
import mmap
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from hostmem import load_readonly, read_cgroup_memory, read_status, track_peak_anon
from hostmem.peak import PeakTracker, PeakTrackerError

MiB = 1024 * 1024


def write_sparse_safetensors(path, n_bytes: int) -> str:
    """A valid safetensors file of one F32 tensor whose data is a hole (costs no disk)."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [n_bytes // 4], "data_offsets": [0, n_bytes]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(header)))
        handle.write(header)
        handle.truncate(8 + len(header) + n_bytes)
    return os.fspath(path)


def wait_for(condition, what: str, timeout_s: float = 30.0, step_s: float = 0.01) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout_s``.

    The deadline is generous on purpose: a loaded two-core machine may delay a
    process for seconds, and a test should fail because a feature broke, not
    because the machine was busy.
    """
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s:g} s")
        time.sleep(step_s)


def process_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` from /proc/PID/stat (R, S, T, Z...), None once gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def hold_gil(seconds: float) -> None:
    """Keep the GIL for ``seconds`` in one C call that never releases it."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(200_000))


def test_an_allocation_is_tracked_and_the_figures_agree_with_status():
    before = read_status().rss_anon
    with track_peak_anon() as peak:
        block = torch.empty(256 * MiB, dtype=torch.uint8).fill_(1)
        held = read_status().rss_anon
        seen = peak.peak_bytes  # a figure read while running comes with a fresh sample
        del block
        time.sleep(0.05)  # longer than a timeline bucket: the last point is after the free
    assert abs(peak.baseline_bytes - before) < 32 * MiB
    assert abs(seen - held) < 16 * MiB  # the sampler reads the counter status prints as RssAnon
    assert 250 * MiB <= peak.growth_bytes <= 300 * MiB
    assert peak.peak_bytes == peak.baseline_bytes + peak.growth_bytes
    assert peak.samples >= 3  # the baseline, the read inside the block, the last one at stop
    assert 0 < peak.peak_t_s <= peak.duration_s
    assert (peak.peak_t_s, peak.peak_bytes) in [tuple(p) for p in peak.timeline]
    assert peak.timeline[-1][1] < peak.baseline_bytes + 64 * MiB  # freed before the end


def test_figures_are_live_while_the_tracker_runs():
    tracker = PeakTracker().start()
    try:
        assert tracker.growth_bytes < 32 * MiB
        block = torch.empty(128 * MiB, dtype=torch.uint8).fill_(1)
        assert tracker.growth_bytes >= 120 * MiB
        # Between reads the sampler goes on by itself. Each read adds one sample of its
        # own, so count only the samples beyond the reads.
        first, reads = tracker.samples, 0

        def sampled_alone() -> bool:
            nonlocal reads
            reads += 1
            return tracker.samples - first - reads >= 10

        wait_for(sampled_alone, "10 samples taken between reads of the figures")
        del block
    finally:
        tracker.stop()
    assert tracker.growth_bytes >= 120 * MiB
    assert not tracker.running


def test_sampling_goes_on_while_the_tracked_process_holds_the_gil():
    with track_peak_anon() as peak:
        before = peak.samples
        hold_gil(0.5)
        during = peak.samples - before - 1  # less the sample that this read adds
    # An in-process thread could take no sample while the GIL is held: its longest gap
    # would span the whole hold. The sampler keeps a 1 ms rhythm; half the hold leaves
    # room for a machine that delays it.
    assert peak.max_gap_s < 0.25, f"no sample for {peak.max_gap_s * 1000:.0f} ms while the GIL was held 500 ms"
    assert during >= 2, f"only {during} samples while the GIL was held for 500 ms"


def test_a_64mib_spike_that_lives_25_ms_is_caught():
    caught, judged = 0, 0
    for _ in range(5):
        with track_peak_anon() as peak:
            block = torch.empty(64 * MiB, dtype=torch.uint8).fill_(1)  # resident in ~30 ms
            hold_gil(0.025)
            del block
        if peak.max_gap_s < 0.025:  # a starved sampler cannot be judged on a 25 ms spike
            judged += 1
            caught += peak.growth_bytes >= 60 * MiB
    if not judged:
        pytest.skip("the machine starved the sampler for 25 ms or more in every run")
    assert caught == judged


def test_a_file_backed_read_is_not_counted(tmp_path):
    path = write_sparse_safetensors(tmp_path / "model.safetensors", 256 * MiB)
    with track_peak_anon() as peak:
        tensors = load_readonly(path)
        file_before = read_status().rss_file
        assert float(tensors["w"].sum()) == 0.0
        file_grew = read_status().rss_file - file_before
        del tensors
    assert file_grew >= 250 * MiB  # the pages were really read in
    assert peak.growth_bytes < 16 * MiB


def test_a_copy_on_write_into_a_private_mapping_is_counted(tmp_path):
    path = write_sparse_safetensors(tmp_path / "model.safetensors", 128 * MiB)
    with open(path, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    weight = torch.frombuffer(mapped, dtype=torch.uint8)
    float(weight.sum())  # page in first: the write below allocates nothing new
    with track_peak_anon() as peak:
        weight.add_(1)
    del weight
    mapped.close()
    assert peak.growth_bytes >= 120 * MiB


def test_shmem_is_counted_only_when_asked():
    area = mmap.mmap(-1, 128 * MiB, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    chunk = b"\x01" * MiB  # written 128 times: the only anonymous memory is this 1 MiB
    try:
        with track_peak_anon() as anon_only, track_peak_anon(include_shmem=True) as with_shmem:
            for _ in range(128):
                area.write(chunk)
    finally:
        area.close()
    # both stop while the area is still mapped, so their last samples hold it
    assert with_shmem.growth_bytes >= 120 * MiB
    assert anon_only.growth_bytes < 16 * MiB


CHILD = textwrap.dedent(
    """
    import sys, time
    block = b"\\x01" * (256 * 1024 * 1024)
    sys.stdout.write("ready\\n"); sys.stdout.flush()
    sys.stdin.readline()
    """
)


def test_children_adds_the_memory_of_descendants():
    with track_peak_anon(children=True) as tree, track_peak_anon() as alone:
        child = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert child.stdout.readline() == "ready\n"
        # the tree is rescanned every 5 ms; a busy machine may take much longer
        wait_for(lambda: tree.growth_bytes >= 250 * MiB, "the child's 256 MiB counted by children=True")
        child.communicate("\n", timeout=30)
    assert tree.to_dict()["processes"] >= 2
    assert alone.growth_bytes < 64 * MiB


def test_another_process_can_be_tracked_and_a_missing_one_is_named():
    child = subprocess.Popen([sys.executable, "-I", "-S", "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        with track_peak_anon(child.pid) as peak:
            assert child.stdout.readline() == b"ready\n"
        assert peak.peak_bytes >= 250 * MiB  # the last sample, at stop, holds the child's block
    finally:
        child.communicate(b"\n", timeout=30)
    with pytest.raises(PeakTrackerError, match=rf"/proc/{child.pid}"):
        PeakTracker(child.pid).start()


def test_the_timeline_stays_short_and_keeps_the_peak():
    peak_points = PeakTracker(timeline_points=8).start()
    time.sleep(0.1)
    block = torch.empty(64 * MiB, dtype=torch.uint8).fill_(1)
    del block
    time.sleep(0.2)
    peak_points.stop()
    timeline = peak_points.timeline
    assert 2 <= len(timeline) <= 9
    assert max(v for _, v in timeline) == peak_points.peak_bytes
    assert all(a[0] < b[0] for a, b in zip(timeline, timeline[1:]))


def test_cross_checks_say_what_they_count():
    with track_peak_anon() as outer:
        with track_peak_anon() as inner:
            block = torch.empty(64 * MiB, dtype=torch.uint8).fill_(1)
            assert outer.growth_bytes >= 60 * MiB  # seen by a sample: VmHWM has nothing to add
            del block
    assert outer.hwm_bytes is not None and outer.hwm_bytes >= outer.to_dict()["peak_anon_bytes"]
    assert outer.unseen_rss_bytes is not None and outer.unseen_rss_bytes < 32 * MiB
    assert inner.hwm_bytes is None  # the outer tracker owns this process's VmHWM
    text = outer.cross_check_text()
    assert "file-backed included" in text
    cgroup = read_cgroup_memory()
    if cgroup is None or cgroup.peak_bytes is None:
        pytest.skip("this process's memory cgroup offers no peak counter")
    assert outer.cgroup is not None and "page cache" in outer.cgroup.includes
    assert "page cache" in text


def test_vmhwm_shows_a_spike_the_sampler_missed():
    tracker = PeakTracker().start()
    sampler = tracker.sampler_pid
    os.kill(sampler, signal.SIGSTOP)  # the sampler misses everything from here
    try:
        wait_for(lambda: process_state(sampler) == "T", f"sampler {sampler} stopped by SIGSTOP")
        block = torch.empty(128 * MiB, dtype=torch.uint8).fill_(1)
        del block
    finally:
        os.kill(sampler, signal.SIGCONT)
        tracker.stop()
    assert tracker.growth_bytes < 16 * MiB
    assert tracker.unseen_rss_bytes >= 120 * MiB
    assert "a spike fell between samples" in tracker.cross_check_text()


def test_to_dict_is_json_with_sizes_in_bytes():
    with track_peak_anon() as peak:
        pass
    data = json.loads(json.dumps(peak.to_dict()))
    for key in ("peak_anon_bytes", "baseline_anon_bytes", "growth_anon_bytes", "samples"):
        assert isinstance(data[key], int)
    assert isinstance(data["duration_s"], float)
    assert all(len(point) == 2 for point in data["timeline"])
    assert "MiB" in peak.summary() or "GiB" in peak.summary()


def test_misuse_gets_a_clear_error():
    with pytest.raises(ValueError, match="interval_s"):
        PeakTracker(interval_s=0)
    with pytest.raises(PeakTrackerError, match="not been started"):
        PeakTracker().peak_bytes
    tracker = PeakTracker().start()
    try:
        with pytest.raises(PeakTrackerError, match="already running"):
            tracker.start()
    finally:
        tracker.stop()


def test_the_sampler_ends_with_the_process_that_started_it():
    code = textwrap.dedent(
        """
        import os, sys
        from hostmem.peak import PeakTracker
        tracker = PeakTracker().start()
        print(tracker.sampler_pid, flush=True)
        os._exit(0)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    sampler = int(done.stdout.split()[0])
    # gone, or a zombie waiting for its new parent to reap it
    wait_for(lambda: process_state(sampler) in (None, "Z"), f"sampler {sampler} ending after its tracker's process")
