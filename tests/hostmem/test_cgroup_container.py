"""A container's memory cgroup, found through mountinfo's root field.

Docker and Kubernetes on cgroup v1 without a cgroup namespace: /proc/self/cgroup names
``/docker/<id>``, and the memory hierarchy is mounted from that same folder, so the
process's own group is the mount point. The fixtures are the kernel's files (cgroup,
mountinfo, the limit files) in a temporary tree, read by the same functions as /proc.
"""

from __future__ import annotations

import os

import pytest

from hostmem.procfs import read_cgroup_memory
from hostmem.procfs.cgroup import folder_in_mount, memory_cgroup_dir
from hostmem.procfs.mounts import Mount, parse_mountinfo

MiB = 1024 * 1024
GiB = 1024 * MiB
NO_LIMIT_V1 = 9223372036854771712  # what v1 writes for "no limit"
ID = "3f1c9e2b7a"


def _v1_stat(rss: int, inactive_file: int, active_file: int, hierarchical: int = NO_LIMIT_V1) -> str:
    """memory.stat of a v1 group, in the kernel's order and names (per group, then total_*)."""
    cache = inactive_file + active_file
    lines = [("cache", cache), ("rss", rss), ("rss_huge", 0), ("shmem", 0), ("mapped_file", 0),
             ("inactive_anon", 0), ("active_anon", rss), ("inactive_file", inactive_file),
             ("active_file", active_file), ("unevictable", 0), ("hierarchical_memory_limit", hierarchical),
             ("total_cache", cache), ("total_rss", rss), ("total_shmem", 0), ("total_inactive_anon", 0),
             ("total_active_anon", rss), ("total_inactive_file", inactive_file), ("total_active_file", active_file)]
    return "".join(f"{k} {v}\n" for k, v in lines)


def _write(path, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as handle:
        handle.write(text)


def _container_v1(tmp_path, group: str = f"/docker/{ID}") -> tuple[str, str]:
    """``(proc_dir, mount point)`` of a v1 container whose memory hierarchy is mounted from its own group."""
    mount = tmp_path / "sys" / "fs" / "cgroup" / "memory"
    proc = tmp_path / "proc" / "self"
    _write(proc / "cgroup", f"12:pids:/docker/{ID}\n4:memory:{group}\n1:name=systemd:/docker/{ID}\n0::/system.slice\n")
    _write(proc / "mountinfo",
           f"611 610 0:52 / / rw,relatime master:231 - overlay overlay rw,lowerdir=/l,upperdir=/u,workdir=/w\n"
           f"620 619 0:29 /docker/{ID} {tmp_path}/sys/fs/cgroup/pids ro,nosuid,nodev,noexec,relatime master:15 "
           f"- cgroup cgroup rw,pids\n"
           f"624 619 0:33 /docker/{ID} {mount} ro,nosuid,nodev,noexec,relatime master:19 - cgroup cgroup rw,memory\n")
    _write(mount / "memory.limit_in_bytes", f"{2 * GiB}\n")
    _write(mount / "memory.usage_in_bytes", f"{900 * MiB}\n")
    _write(mount / "memory.max_usage_in_bytes", f"{1000 * MiB}\n")
    _write(mount / "memory.stat", _v1_stat(600 * MiB, 200 * MiB, 100 * MiB, hierarchical=2 * GiB))
    return str(proc), str(mount)


def test_a_v1_container_without_a_cgroup_namespace_reads_its_own_limit(tmp_path):
    proc, mount = _container_v1(tmp_path)
    assert memory_cgroup_dir(proc_dir=proc) == (1, mount, mount)  # not mount + /docker/<id>, which is absent
    group = read_cgroup_memory(proc_dir=proc)
    assert (group.version, group.path, group.limit_bytes) == (1, mount, 2 * GiB)
    assert group.usage_bytes == 900 * MiB and group.peak_bytes == 1000 * MiB
    assert group.reclaimable_bytes == 300 * MiB and group.unreclaimable_bytes == 600 * MiB


def test_a_group_nested_in_the_container_takes_the_limit_of_the_container(tmp_path):
    proc, mount = _container_v1(tmp_path, group=f"/docker/{ID}/workers/serve")
    inner = os.path.join(mount, "workers", "serve")
    _write(os.path.join(inner, "memory.limit_in_bytes"), f"{NO_LIMIT_V1}\n")
    _write(os.path.join(inner, "memory.usage_in_bytes"), f"{300 * MiB}\n")
    _write(os.path.join(inner, "memory.stat"), _v1_stat(250 * MiB, 50 * MiB, 0))
    group = read_cgroup_memory(proc_dir=proc)
    assert group.path == inner and group.limit_bytes == 2 * GiB  # from the container's group, up the hierarchy
    assert group.unreclaimable_bytes == 250 * MiB


def test_v1_states_the_limit_of_ancestors_the_container_cannot_see(tmp_path):
    proc, mount = _container_v1(tmp_path)
    _write(os.path.join(mount, "memory.limit_in_bytes"), f"{NO_LIMIT_V1}\n")
    _write(os.path.join(mount, "memory.stat"), _v1_stat(600 * MiB, 200 * MiB, 100 * MiB, hierarchical=3 * GiB))
    assert read_cgroup_memory(proc_dir=proc).limit_bytes == 3 * GiB


@pytest.mark.parametrize("group, root, folder", [
    ("/kubepods/pod7/c1", "/kubepods/pod7/c1", ""),       # v2 without a namespace: mounted from its own group
    ("/", "/", ""),                                         # v2 with a cgroup namespace: both read /
    ("/user.slice/user-1000.slice/app-7.scope", "/", "user.slice/user-1000.slice/app-7.scope"),  # a host
])
def test_v2_groups_are_found_through_the_root_field(tmp_path, group, root, folder):
    mount = tmp_path / "sys" / "fs" / "cgroup"
    proc = tmp_path / "proc" / "self"
    _write(proc / "cgroup", f"0::{group}\n")
    _write(proc / "mountinfo", f"30 25 0:26 {root} {mount} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n")
    where = os.path.join(mount, folder) if folder else str(mount)
    _write(os.path.join(where, "memory.max"), f"{4 * GiB}\n")
    _write(os.path.join(where, "memory.current"), f"{GiB}\n")
    _write(os.path.join(where, "memory.stat"), f"anon {700 * MiB}\nfile {324 * MiB}\nshmem {24 * MiB}\n"
                                               f"inactive_file {200 * MiB}\nactive_file {100 * MiB}\n")
    read = read_cgroup_memory(proc_dir=str(proc))
    assert (read.version, read.path.rstrip("/"), read.limit_bytes) == (2, where.rstrip("/"), 4 * GiB)
    assert read.unreclaimable_bytes == 724 * MiB  # anon and shmem: file less shmem is what can be dropped


def test_a_group_outside_what_the_mount_shows_is_not_joined_to_it():
    mount = Mount("/sys/fs/cgroup/memory", "cgroup", "rw,memory", root=f"/docker/{ID}")
    assert folder_in_mount(mount, f"/docker/{ID}/a") == "/sys/fs/cgroup/memory/a"
    assert folder_in_mount(mount, "/docker/other") is None
    assert folder_in_mount(mount, f"/docker/{ID}x") is None  # a prefix of a name is not its parent


def test_mountinfo_root_fields_are_unescaped():
    (mount,) = parse_mountinfo(r"40 31 0:40 /a\040b /mnt/x\040y rw - ext4 /dev/sda1 rw" + "\n")
    assert (mount.root, mount.mount_point, mount.fs_type) == ("/a b", "/mnt/x y", "ext4")


def test_this_machines_own_group_is_found_as_before():
    """The real /proc through the same functions: the group found exists (where there is one)."""
    found = memory_cgroup_dir()
    if found is None:
        pytest.skip("this process is in no memory cgroup this machine exposes")
    assert os.path.isdir(found[1]) and found[1].startswith(found[2])
