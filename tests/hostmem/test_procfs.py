"""The /proc and cgroup readers on this machine's real files."""

import mmap
import os
import subprocess
import sys

import pytest
import torch

from hostmem.procfs import (
    ProcReadError,
    filesystem_of,
    read_cgroup_memory,
    read_cgroup_v1_dir,
    read_cgroup_v2_dir,
    read_meminfo,
    read_smaps,
    read_status,
)

MiB = 1024 * 1024


def test_status_sees_anonymous_growth():
    # a mapping of its own: an allocator may hand back memory an earlier test left resident
    area = mmap.mmap(-1, 64 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        before = read_status()
        torch.frombuffer(area, dtype=torch.uint8).fill_(1)
        after = read_status()
        assert after.rss_anon - before.rss_anon >= 60 * MiB
        assert after.vm_hwm >= after.vm_rss
    finally:
        area.close()


def test_status_of_another_process_and_of_a_missing_one():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        status = read_status(child.pid)
        assert status.vm_rss > 0
    finally:
        child.kill()
        child.wait()
    with pytest.raises(ProcReadError, match=rf"/proc/{child.pid}/status: not found"):
        read_status(child.pid)


def test_smaps_lists_areas_with_flags_and_paths():
    vmas = read_smaps()
    assert vmas == sorted(vmas, key=lambda v: v.start)
    heap = [v for v in vmas if v.path == "[heap]"]
    assert heap and heap[0].anonymous > 0
    assert all(v.vm_flags for v in vmas)
    assert any(v.path and v.path.endswith(".so") or v.path and ".so." in v.path for v in vmas)


def test_meminfo_reads_the_machine():
    info = read_meminfo()
    assert info.total > info.available > 0


def test_filesystem_of_knows_tmpfs():
    if os.path.isdir("/dev/shm"):
        assert filesystem_of("/dev/shm").fs_type == "tmpfs"
    assert filesystem_of("/").mount_point == "/"


def test_a_mount_names_its_superblocks_device_as_stat_and_proc_locks_do(tmp_path):
    """mountinfo's MAJ:MIN is the device /proc/locks names a file's by; on a filesystem without
    subvolumes it is stat's own."""
    mount = filesystem_of(os.fspath(tmp_path))
    assert mount.device is not None
    if mount.fs_type not in ("btrfs", "overlay"):
        assert mount.device == os.stat(tmp_path).st_dev


def test_own_memory_cgroup_is_read_when_present():
    cgroup = read_cgroup_memory()
    if cgroup is None:
        pytest.skip("this process is in no memory cgroup this machine exposes")
    assert cgroup.version in (1, 2)
    assert cgroup.usage_bytes > 0
    assert "cache" in cgroup.stat or "file" in cgroup.stat


def _write(folder, files: dict[str, str]):
    os.makedirs(folder, exist_ok=True)
    for name, text in files.items():
        with open(os.path.join(folder, name), "w") as handle:
            handle.write(text)


V2_STAT = """anon 104857600
file 209715200
kernel 4194304
shmem 1048576
file_mapped 52428800
file_dirty 0
"""


def test_cgroup_v2_files_in_the_kernels_format(tmp_path):
    root = tmp_path / "unified"
    leaf = root / "system.slice" / "server.service"
    _write(root / "system.slice", {"memory.max": "34359738368\n"})
    _write(leaf, {"memory.max": "max\n", "memory.current": "320864256\n", "memory.peak": "402653184\n",
                  "memory.stat": V2_STAT})
    cgroup = read_cgroup_v2_dir(str(leaf), str(root))
    assert cgroup.version == 2
    assert cgroup.limit_bytes == 32 * 1024**3  # the parent's limit binds
    assert cgroup.usage_bytes == 320864256
    assert cgroup.peak_bytes == 402653184
    assert cgroup.stat["anon"] == 104857600 and cgroup.stat["file"] == 209715200


def test_cgroup_v2_without_peak_and_without_limit(tmp_path):
    _write(tmp_path, {"memory.max": "max\n", "memory.current": "4096\n", "memory.stat": V2_STAT})
    cgroup = read_cgroup_v2_dir(str(tmp_path))
    assert cgroup.limit_bytes is None and cgroup.peak_bytes is None


def test_cgroup_v1_unlimited_is_none(tmp_path):
    _write(tmp_path, {"memory.limit_in_bytes": "9223372036854771712\n", "memory.usage_in_bytes": "8192\n",
                      "memory.max_usage_in_bytes": "16384\n", "memory.stat": "cache 4096\nrss 4096\n"})
    cgroup = read_cgroup_v1_dir(str(tmp_path))
    assert cgroup.limit_bytes is None
    assert cgroup.peak_bytes == 16384


def test_a_garbled_cgroup_file_names_itself(tmp_path):
    _write(tmp_path, {"memory.max": "lots\n", "memory.current": "1\n", "memory.stat": ""})
    with pytest.raises(ProcReadError, match=r"memory.max: expected a number or 'max'"):
        read_cgroup_v2_dir(str(tmp_path))



def test_mapped_areas_place_an_address_as_a_full_read_of_maps_does(tmp_path):
    """MappedAreas parses an area only when asked; what it answers equals read_maps'."""
    import mmap
    import warnings

    from hostmem.procfs.maps import read_maps
    from hostmem.slots import MappedAreas

    path = tmp_path / "weights.bin"
    path.write_bytes(b"\1" * (3 * mmap.PAGESIZE))
    with open(path, "rb") as handle:
        mapping = mmap.mmap(handle.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # not writable: on purpose
            mapped = torch.frombuffer(mapping, dtype=torch.uint8)
        heap = torch.ones(1 << 20, dtype=torch.uint8)
        areas, full = MappedAreas(), read_maps()
        for address in (mapped.data_ptr() + mmap.PAGESIZE, heap.data_ptr()):
            assert areas.area_at(address) == next(a for a in full if a.start <= address < a.end)
        assert areas.area_at(mapped.data_ptr()).path == str(path)
        assert areas.read_only_file(mapped) == str(path) and areas.read_only_file(heap) is None
        assert areas.area_at(0) is None
        del mapped
    finally:
        mapping.close()


def test_io_bytes_of_this_process_and_another_and_a_gone_one():
    from hostmem.procfs import ProcReadError, read_io_bytes

    assert read_io_bytes() >= 0
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        assert read_io_bytes(child.pid) >= 0
    finally:
        child.kill()
        child.wait()
    with pytest.raises(ProcReadError, match=rf"/proc/{child.pid}/io: not found"):
        read_io_bytes(child.pid)
