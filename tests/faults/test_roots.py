"""Where the cache lives: a read-only image root, another user's folder, planted links,
a full disk, a file-size limit, a build stopped by a signal."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from hostmem.vault import VaultError
from tests.conftest import run_python
from tests.faults.world import (
    LAYERS,
    assert_same,
    combination_folder,
    flip_byte,
    leftovers,
    make_world,
    reference,
    start,
)


def test_a_cache_baked_into_a_read_only_root_serves_a_copied_base(tmp_path, read_only_copy, capfd):
    world = make_world(tmp_path)
    expected = reference(world.base, world.adapter)
    start(world.base, world.adapter, world.path("image-build"))
    baked = read_only_copy(world.path("image-build"))
    os.mkdir(world.path("host"))
    base = world.path("host", "base.safetensors")
    subprocess.run(["cp", world.base, base], check=True)  # unpacked on another host: new inode, new times
    local = world.path("local")
    served, stats = start(base, world.adapter, [baked, local])
    assert_same(served, expected)
    assert (stats.hit, stats.built) == (LAYERS, 0) and stats.cache_root == baked
    assert not os.path.exists(os.path.join(local, "lora_merge_cache", stats.cache_key))  # nothing rebuilt locally
    assert "failed its check" not in capfd.readouterr().err
    from planners.cli import main

    assert main(["cache", "verify", "--root", baked]) == 0  # verified in place: no lock file, no record
    assert main(["cache", "ls", "--root", baked]) == 0
    out = capfd.readouterr().out
    assert f"{stats.cache_key[:12]}  ok" in out and " complete " in out, out


def test_a_damaged_read_only_root_is_not_served_and_the_writable_root_builds(tmp_path, read_only_copy, capfd):
    world = make_world(tmp_path)
    expected = reference(world.base, world.adapter)
    start(world.base, world.adapter, world.path("image-build"))
    folder = combination_folder(world.path("image-build"))
    layer = next(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    flip_byte(os.path.join(folder, layer), os.path.getsize(os.path.join(folder, layer)) - 5)
    baked = read_only_copy(world.path("image-build"))
    capfd.readouterr()
    served, stats = start(world.base, world.adapter, [baked, world.path("local")])
    seen = capfd.readouterr().err
    assert_same(served, expected)
    assert stats.built == LAYERS and stats.cache_root == world.path("local")
    assert layer in seen and "content checksum" in seen and "read-only root" in seen, seen


def test_a_build_in_a_writable_root_listed_after_another_is_served_and_nothing_is_built_again(tmp_path):
    world = make_world(tmp_path)
    expected = reference(world.base, world.adapter)
    start(world.base, world.adapter, world.path("image"))  # what `hostmem lora merge` leaves in an image root
    first = world.path("local")  # a server's own writable root, listed first and empty
    served, stats = start(world.base, world.adapter, [first, world.path("image")])
    assert_same(served, expected)
    assert (stats.hit, stats.built) == (LAYERS, 0) and stats.cache_root == world.path("image"), stats
    assert not os.path.exists(os.path.join(first, "lora_merge_cache", stats.cache_key))


def test_only_a_read_only_root_without_the_combination_merges_in_place_with_one_warning(tmp_path, read_only_copy):
    world = make_world(tmp_path)
    os.mkdir(world.path("empty"))
    baked = read_only_copy(world.path("empty"))
    expected = reference(world.base, world.adapter)
    with pytest.warns(UserWarning) as caught:
        served, stats = start(world.base, world.adapter, [baked])
    assert_same(served, expected)
    assert stats.fallen_back == LAYERS and stats.built == 0
    said = [str(w.message) for w in caught if "read-only" in str(w.message)]
    assert len(said) == 1 and "lora.cache.roots" in said[0], [str(w.message) for w in caught]
    assert os.listdir(world.path("empty")) == []


@pytest.mark.parametrize("where", ["root", "cache folder"])
def test_a_root_another_user_owns_is_refused_saying_what_to_change(tmp_path, where):
    world = make_world(tmp_path)
    root = world.path("root")
    start(world.base, world.adapter, root)
    path = root if where == "root" else os.path.join(root, "lora_merge_cache")
    os.chown(path, 12345, 12345)
    with pytest.raises(VaultError, match=r"owned by uid 12345.*chown"):
        start(world.base, world.adapter, root)
    os.chmod(path, 0o777)
    os.chown(path, os.geteuid(), os.getegid())
    with pytest.raises(VaultError, match=r"writable by every user.*chmod go-w"):
        start(world.base, world.adapter, root)


@pytest.mark.parametrize("planted", ["manifest.json", "verified.json", "a layer file"])
def test_a_planted_symlink_is_never_written_through(tmp_path, planted):
    world = make_world(tmp_path)
    expected, root = reference(world.base, world.adapter), world.path("root")
    start(world.base, world.adapter, root)
    folder = combination_folder(root)
    name = next(n for n in os.listdir(folder) if n.endswith(".safetensors")) if planted == "a layer file" else planted
    victim = world.path("victim")
    with open(victim, "w") as handle:
        handle.write("precious")
    os.unlink(os.path.join(folder, name))
    os.symlink(victim, os.path.join(folder, name))
    try:
        served, stats = start(world.base, world.adapter, root)
    except VaultError as exc:  # refused, saying which link and what to do
        assert "is a symlink" in str(exc) and name in str(exc)
    else:
        assert_same(served, expected)
    with open(victim) as handle:
        assert handle.read() == "precious"


def test_a_full_filesystem_merges_in_place_with_the_numbers(tmp_path):
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4"):
        pytest.skip("needs root and mkfs.ext4 to make a small filesystem")
    image, point = tmp_path / "fs.img", tmp_path / "mnt"
    point.mkdir()
    with open(image, "wb") as handle:
        handle.truncate(8 << 20)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], capture_output=True)
    if made.returncode or subprocess.run(["mount", "-o", "loop", str(image), str(point)], capture_output=True).returncode:
        pytest.skip("cannot loop-mount a filesystem here")
    try:
        with open(point / "filler", "wb") as handle:  # leave less than the cache needs
            handle.truncate(0)
            os.posix_fallocate(handle.fileno(), 0, os.statvfs(point).f_bavail * os.statvfs(point).f_frsize - (300 << 10))
        world = make_world(tmp_path)
        expected = reference(world.base, world.adapter)
        with pytest.warns(UserWarning, match=r"no room for the LoRA merge cache.*needs .*available"):
            served, stats = start(world.base, world.adapter, str(point / "root"))
        assert_same(served, expected)
        assert stats.fallen_back >= 1 and stats.hit + stats.built + stats.fallen_back == LAYERS
        assert not leftovers(str(point))
    finally:
        subprocess.run(["umount", str(point)], capture_output=True)


FSIZE = """
import resource, signal, sys, warnings, torch
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
from tests.faults.world import reference, start
base, adapter, root = sys.argv[1:4]
expected = reference(base, adapter)
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))  # under one 32 KiB layer file
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    served, stats = start(base, adapter, root)
print(all(torch.equal(served[n], t) for n, t in expected.items()), stats.fallen_back, stats.built)
print(" | ".join(str(w.message) for w in caught))
"""


def test_a_file_size_limit_merges_in_place_and_says_why(tmp_path):
    world = make_world(tmp_path)
    done = run_python(FSIZE, world.base, world.adapter, world.path("root"), cwd=os.getcwd())
    assert done.returncode == 0, done.stderr[-2000:]
    verdict, said = done.stdout.splitlines()[:2]
    assert verdict.split()[:2] == ["True", str(LAYERS)], done.stdout
    assert "File too large" in said and "Merging in place instead" in said
    assert not leftovers(world.path("root"))


def _merge_config(world) -> str:
    """A deployment config merging the world's adapter into its base through its root."""
    config = world.path("deploy.yaml")
    with open(config, "w") as handle:
        handle.write(
            f"deployment: faults\nhost: {{limit: 8GiB, reserve: 1GiB}}\nworkload: {{steps: 4}}\n"
            f"components:\n  dit: {{path: {world.base}, offload: layerwise, layers: \"blocks.{{i}}.\"}}\n"
            f"lora:\n  adapters: [{{path: {world.adapter}}}]\n  cache: {{roots: [{world.path('root')}]}}\n"
        )
    return config


def test_sigterm_during_hostmem_lora_merge_exits_130_and_the_next_start_resumes(tmp_path):
    world = make_world(tmp_path)
    config = _merge_config(world)
    code = (
        "import sys, time, hostmem.vault.session as s\n"
        "real = s.write_layer_data\n"
        "def slow(*a, **k):\n    print('writing', flush=True)\n    time.sleep(0.4)\n    return real(*a, **k)\n"
        "s.write_layer_data = slow\n"  # each layer takes a while, so the signal lands mid-build
        "from planners.cli import main\nsys.exit(main(['lora', 'merge', sys.argv[1], '--no-progress']))\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code, config], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "writing"  # the build is under way
    time.sleep(1.0)  # a layer or two sealed
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 130, err[-2000:]
    lines = [l for l in err.splitlines() if l.startswith("hostmem: interrupted")]
    assert len(lines) == 1 and "sealed in the LoRA merge cache" in lines[0] and "resumes" in lines[0], err
    assert not leftovers(world.path("root"))
    served, stats = start(world.base, world.adapter, world.path("root"))
    assert_same(served, reference(world.base, world.adapter))
    assert stats.hit + stats.built == LAYERS


def test_a_second_sigterm_while_the_first_cleans_up_ends_the_merge_at_once_and_nothing_wrong_is_served(tmp_path):
    """The first signal's clean-up waits for the layer being written (2 s here); a second
    signal is neither ignored (a merge that could only be stopped by SIGKILL) nor allowed
    to tear it: the process ends at once, as the signal's default action, after one line,
    and what it sealed serves the next start right."""
    world = make_world(tmp_path)
    config = _merge_config(world)
    code = (
        "import sys, time, hostmem.vault.session as s\n"
        "real = s.write_layer_data\n"
        "def slow(*a, **k):\n    print('writing', flush=True)\n    time.sleep(2)\n    return real(*a, **k)\n"
        "s.write_layer_data = slow\n"
        "import planners.commands.stopping as stopping\n"
        "handle = stopping.Stop.handle\n"
        "def told(self, signum, frame):\n"
        "    first = self.seen is None\n"
        "    try:\n        return handle(self, signum, frame)\n"
        "    finally:\n        if first:\n            print('stopping', flush=True)\n"
        "stopping.Stop.handle = told\n"  # says once the first signal was taken: two sent at once are one
        "from planners.cli import main\nsys.exit(main(['lora', 'merge', sys.argv[1], '--no-progress']))\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code, config], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "writing"
    child.send_signal(signal.SIGTERM)
    assert child.stdout.readline().strip() == "stopping"  # its clean-up now waits for the write under way
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGTERM, err[-2000:]
    assert "hostmem: SIGTERM again: stopping at once; what was sealed stays" in err, err
    served, stats = start(world.base, world.adapter, world.path("root"))
    assert_same(served, reference(world.base, world.adapter))
    assert stats.hit + stats.built == LAYERS


def _catches_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has a SIGTERM handler (``SigCgt`` of /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as status:
        caught = next(int(line.split()[1], 16) for line in status if line.startswith("SigCgt:"))
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def test_sigterm_before_the_build_begins_exits_130_with_its_line(tmp_path):
    """The command stops on SIGTERM from its first import on (imports, config, mapping take
    seconds before a layer is written): it caught SIGTERM before torch was loaded, and a
    signal then ends it with exit 130 and its one line, not the default action's silence."""
    world = make_world(tmp_path)
    config = _merge_config(world)
    child = subprocess.Popen([sys.executable, "-m", "planners.cli", "lora", "merge", config, "--no-progress"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not _catches_sigterm(child.pid) and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    with open(f"/proc/{child.pid}/maps") as maps:
        torch_loaded = "libtorch" in maps.read()
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=60)
    assert not torch_loaded
    assert child.returncode == 130, err[-2000:]
    lines = [l for l in err.splitlines() if l.startswith("hostmem: interrupted (SIGTERM)")]
    assert len(lines) == 1 and "no layer sealed" in lines[0] and "Traceback" not in err, err
    assert not leftovers(world.path("root"))


def test_sigterm_while_the_finished_build_prints_says_it_finished(tmp_path):
    """The build is sealed and its figures are being printed (stdout a full pipe, so the
    write waits) when SIGTERM comes: the line says the build finished, not "no layer sealed"."""
    import fcntl

    world = make_world(tmp_path)
    config = _merge_config(world)
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, 1031, 4096)  # F_SETPIPE_SZ: one page, then filled, so the first print waits
    os.write(write_end, b"x" * 4096)
    child = subprocess.Popen([sys.executable, "-m", "planners.cli", "lora", "merge", config, "--no-progress"],
                             stdout=write_end, stderr=subprocess.PIPE, text=True)
    os.close(write_end)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and child.poll() is None:
            with open(f"/proc/{child.pid}/wchan") as wchan:
                if "pipe" in wchan.read():
                    break
            time.sleep(0.01)
        child.send_signal(signal.SIGTERM)
        err = child.communicate(timeout=60)[1]
    finally:
        os.close(read_end)
    assert child.returncode == 130, err[-2000:]
    (line,) = [l for l in err.splitlines() if l.startswith("hostmem: interrupted")]
    assert "after the build finished" in line and "nothing is left to resume" in line, line
