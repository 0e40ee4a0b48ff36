"""A memory cgroup's anonymous figure: memory.stat in both versions, and a real group.

The figure is ``total_rss`` (v1) or ``anon`` (v2), never ``usage``, which counts page
cache too. The sampler program and :class:`MemoryCgroup` each read it (the sampler may
import nothing of hostmem); both are checked against memory.stat in the kernel's own
format for the version this machine lacks, and against a real nested group where the
machine allows one.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hostmem.peak import sampler_program as program
from hostmem.cgroup_sandbox import MemoryCgroup, can_nest_memory_cgroup, memory_cgroup
from hostmem.procfs import ProcReadError

MiB = 1024 * 1024

# A v2 memory.stat as a 6.x kernel prints it (anon_thp and shmem_thp share prefixes).
V2_STAT = """anon 104857600
file 209715200
kernel 4194304
kernel_stack 98304
pagetables 1191936
sec_pagetables 0
percpu 960
sock 0
vmalloc 8192
shmem 1048576
zswap 0
zswapped 0
file_mapped 52428800
file_dirty 0
file_writeback 0
swapcached 0
anon_thp 62914560
file_thp 0
shmem_thp 0
inactive_anon 105906176
active_anon 0
inactive_file 104857600
active_file 104857600
unevictable 0
slab_reclaimable 1048576
slab_unreclaimable 524288
slab 1572864
"""

# A v1 memory.stat: the group's own figures, then the hierarchical total_ ones.
V1_STAT = """cache 209715200
rss 4194304
rss_huge 2097152
shmem 1048576
mapped_file 52428800
dirty 0
writeback 0
swap 0
pgpgin 100
pgpgout 50
hierarchical_memory_limit 9223372036854771712
total_cache 209715200
total_rss 104857600
total_rss_huge 62914560
total_shmem 2097152
total_mapped_file 52428800
"""

FORMATS = [(1, V1_STAT, 100 * MiB, 102 * MiB), (2, V2_STAT, 100 * MiB, 101 * MiB)]


def fake_group(tmp_path, stat: str) -> str:
    folder = tmp_path / "group"
    folder.mkdir()
    (folder / "memory.stat").write_text(stat)
    (folder / "cgroup.procs").write_text(f"{os.getpid()}\n{os.getppid()}\n")
    return str(folder)


@pytest.mark.parametrize("version, stat, anon, with_shmem", FORMATS)
def test_the_sampler_reads_the_group_s_anonymous_figure(tmp_path, version, stat, anon, with_shmem):
    folder = fake_group(tmp_path, stat)
    for shmem, expected in ((False, anon), (True, with_shmem)):
        state = program.Sampling(os.getpid(), shmem, True, 100, 0.005, folder, str(version))
        state.rescan(0.0)
        state.sample()
        assert (state.peak, state.processes) == (expected, 2)


@pytest.mark.parametrize("version, stat, anon, with_shmem", FORMATS)
def test_memory_cgroup_reads_the_same_figure(tmp_path, version, stat, anon, with_shmem):
    group = MemoryCgroup(path=fake_group(tmp_path, stat), version=version, limit_bytes=None)
    assert group.anon_bytes() == anon
    assert group.anon_bytes(include_shmem=True) == with_shmem
    assert group.pids() == [os.getpid(), os.getppid()]


def test_a_missing_stat_file_is_named(tmp_path):
    group = MemoryCgroup(path=str(tmp_path / "gone"), version=2, limit_bytes=None)
    with pytest.raises(ProcReadError, match="gone/memory.stat"):
        group.anon_bytes()
    assert group.pids() == []


READS_AND_ALLOCATES = """
import mmap, sys
with open(sys.argv[1], "rb") as handle:
    mapped = mmap.mmap(handle.fileno(), 0, prot=mmap.PROT_READ)
touched = sum(mapped[i] for i in range(0, len(mapped), 4096))   # 64 MiB of page cache, in the group
block = bytearray(32 << 20)                                     # 32 MiB anonymous, once written
block[::4096] = b"\\x01" * len(range(0, 32 << 20, 4096))
print("ready", flush=True)
sys.stdin.readline()
"""


def usage_bytes(group: MemoryCgroup) -> int:
    """What the group is charged in all, page cache included."""
    name = "memory.usage_in_bytes" if group.version == 1 else "memory.current"
    with open(os.path.join(group.path, name)) as handle:
        return int(handle.read())


@pytest.mark.skipif(can_nest_memory_cgroup() is not None, reason=f"no nested memory cgroup: {can_nest_memory_cgroup()}")
def test_a_real_group_counts_anonymous_memory_and_not_page_cache(tmp_path):
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(MiB) * 64)
    fd = os.open(data, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # dropped, so that the child reads it into the group
    os.close(fd)
    with memory_cgroup(None) as group:
        child = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", READS_AND_ALLOCATES, str(data)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=group.join,
        )
        try:
            assert child.stdout.readline() == "ready\n"
            anon, usage = group.anon_bytes(), usage_bytes(group)
            assert group.pids() == [child.pid]
        finally:
            child.communicate("\n", timeout=30)
    assert 32 * MiB <= anon < 48 * MiB  # the bytearray and the interpreter's own
    assert usage - anon >= 60 * MiB  # the page cache that usage counts and the figure does not
    assert not os.path.exists(group.path)
