"""A set of processes added up with a page they share counted once: real children, real /proc."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from hostmem.cgroup_sandbox import can_nest_memory_cgroup, memory_cgroup
from hostmem.host_aggregate import aggregate_ranges, cgroup_pids, pfns_visible
from hostmem.procfs import ProcReadError, read_maps

MiB = 1024 * 1024
FILE_BYTES, ANON_BYTES = 16 * MiB, 8 * MiB

# Maps the file read-only and shared, reads every page, fills a private buffer, and
# reports the buffer's address; torch is not needed for any of it.
CHILD = r"""
import ctypes, mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
mapped = mmap.mmap(fd, 0, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
sum(mapped[i] for i in range(0, len(mapped), 4096))
if len(sys.argv) > 3:  # lock the file's pages (mlock of every mapped page)
    maps = open("/proc/self/maps").read().splitlines()
    start, end = next(l.split()[0] for l in maps if l.endswith(sys.argv[1])).split("-")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    if libc.mlock(int(start, 16), int(end, 16) - int(start, 16)) != 0:
        print("mlock failed", ctypes.get_errno(), flush=True)
scratch = bytearray(int(sys.argv[2]))
scratch[::4096] = b"\x07" * len(scratch[::4096])
print(ctypes.addressof((ctypes.c_char * len(scratch)).from_buffer(scratch)), flush=True)
sys.stdin.readline()
"""


def _start(path, *extra, **kwargs):
    return subprocess.Popen([sys.executable, "-c", CHILD, path, str(ANON_BYTES), *extra], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, **kwargs)


def _stop(children):
    for child in children:
        if child.poll() is None:
            child.stdin.write("\n")
            child.stdin.flush()
    for child in children:
        child.wait(timeout=30)


@pytest.fixture(scope="module")
def children(tmp_path_factory):
    """Three processes mapping one 16 MiB file, each with 8 MiB of its own: ``(path, {pid: anon address})``."""
    folder = tmp_path_factory.mktemp("aggregate")
    path = os.fspath(folder / "weights.bin")
    with open(path, "wb") as handle:
        handle.write(os.urandom(FILE_BYTES))
    started = [_start(path) for _ in range(3)]
    try:
        yield path, {c.pid: int(c.stdout.readline()) for c in started}
    finally:
        _stop(started)
        shutil.rmtree(folder)


def _file_ranges(pid, path):
    return [(v.start, v.end) for v in read_maps(pid) if v.path == path]


def _near(value, expected):
    return abs(value - expected) <= 0.05 * expected


def test_a_file_mapped_by_three_processes_counts_once_by_page_frame(children):
    if not pfns_visible():
        pytest.skip("page frame numbers read 0 here (no CAP_SYS_ADMIN): the pss test covers this case")
    path, anon = children
    shared = aggregate_ranges({pid: _file_ranges(pid, path) for pid in anon})
    assert shared.precision == "pfn"
    assert _near(shared.totals.file_backed, FILE_BYTES), shared.totals
    assert _near(shared.summed.file_backed, 3 * FILE_BYTES), shared.summed
    assert _near(shared.shared_bytes, 2 * FILE_BYTES)
    own = aggregate_ranges({pid: [(a, a + ANON_BYTES)] for pid, a in anon.items()})
    assert _near(own.totals.anonymous, 3 * ANON_BYTES) and own.shared_bytes == 0  # private pages stay apart


def test_a_page_one_process_pinned_counts_pinned_once_not_also_file_backed(tmp_path):
    if not pfns_visible():
        pytest.skip("page frame numbers read 0 here (no CAP_SYS_ADMIN)")
    path = os.fspath(tmp_path / "weights.bin")
    with open(path, "wb") as handle:
        handle.write(os.urandom(FILE_BYTES))
    started = [_start(path, "lock"), _start(path)]
    try:
        first = started[0].stdout.readline()
        if first.startswith("mlock failed"):
            pytest.skip(f"this process may not mlock 16 MiB ({first.strip()})")
        started[1].stdout.readline()
        both = aggregate_ranges({c.pid: _file_ranges(c.pid, path) for c in started})
    finally:
        _stop(started)
    assert _near(both.per_pid[started[0].pid].pinned, FILE_BYTES)
    assert _near(both.per_pid[started[1].pid].file_backed, FILE_BYTES)
    assert _near(both.totals.pinned, FILE_BYTES) and both.totals.file_backed <= 0.05 * FILE_BYTES, both.totals


def test_without_page_frames_pss_splits_the_shared_file_among_its_three_readers(children):
    path, anon = children
    shared = aggregate_ranges({pid: _file_ranges(pid, path) for pid in anon}, pfns=False)
    assert shared.precision == "pss"
    assert _near(shared.totals.file_backed, FILE_BYTES), shared.totals
    assert _near(shared.summed.file_backed, 3 * FILE_BYTES)


def test_a_reader_without_cap_sys_admin_sees_no_page_frames_and_falls_back_to_pss(children):
    if not pfns_visible():
        pytest.skip("this process itself lacks CAP_SYS_ADMIN")
    path, anon = children
    pid = next(iter(anon))
    code = ("import sys; from hostmem.host_aggregate import aggregate_ranges, pfns_visible; "
            f"r = aggregate_ranges({{{pid}: {_file_ranges(pid, path)!r}}}); print(pfns_visible(), r.precision)")
    done = subprocess.run(["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin", sys.executable, "-c",
                           code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "pss"]


def _inspect(*args):
    return subprocess.run([sys.executable, "-m", "planners.cli", "inspect", *args], capture_output=True, text=True,
                          timeout=120)


def test_inspect_of_several_pids_counts_their_shared_pages_once(children):
    path, anon = children
    pids = list(anon)
    done = _inspect("--pid", str(pids[0]), "--pid", str(pids[1]), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["pids"] == pids[:2] and report["precision"] in ("pfn", "pss")
    totals, summed = report["totals"], report["summed"]
    assert summed["file_backed"] - totals["file_backed"] >= 0.95 * FILE_BYTES  # the file, once not twice
    assert totals["anonymous"] >= 2 * ANON_BYTES
    text = _inspect("--pid", str(pids[0]), "--pid", str(pids[2]))
    assert text.returncode == 0 and "2 processes, shared pages counted once" in text.stdout


def test_inspect_of_a_pid_that_does_not_exist_says_so_in_one_line(children):
    _, anon = children
    done = _inspect("--pid", str(next(iter(anon))), "--pid", "999999999")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert "pid 999999999: no such process" in done.stderr and "Traceback" not in done.stderr


def test_inspect_of_a_cgroup_adds_up_its_processes(tmp_path):
    reason = can_nest_memory_cgroup()
    if reason is not None:
        pytest.skip(f"no memory cgroup to create here: {reason}")
    path = os.fspath(tmp_path / "weights.bin")
    with open(path, "wb") as handle:
        handle.write(os.urandom(FILE_BYTES))
    with memory_cgroup(None) as group:
        started = [_start(path, preexec_fn=group.join) for _ in range(2)]
        try:
            for child in started:
                child.stdout.readline()
            done = _inspect("--cgroup", group.path, "--json")
        finally:
            _stop(started)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert sorted(report["pids"]) == sorted(c.pid for c in started)
    assert report["summed"]["file_backed"] - report["totals"]["file_backed"] >= 0.95 * FILE_BYTES


def test_cgroup_pids_reads_cgroup_procs_and_names_a_folder_that_is_none(tmp_path):
    (tmp_path / "cgroup.procs").write_text("812\n1203\n")  # the kernel's format, v1 and v2 alike
    assert cgroup_pids(tmp_path) == [812, 1203]
    with pytest.raises(ProcReadError, match="no such cgroup folder"):
        cgroup_pids(tmp_path / "missing")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ProcReadError, match="no cgroup.procs"):
        cgroup_pids(tmp_path / "plain")
    done = _inspect("--cgroup", os.fspath(tmp_path / "plain"))
    assert done.returncode == 2 and "no cgroup.procs (not a cgroup folder)" in done.stderr


def test_adding_up_whole_processes_does_not_import_torch(children):
    _, anon = children
    code = ("import sys; from hostmem.host_aggregate import aggregate_processes; "
            f"aggregate_processes({list(anon)!r}); print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr
