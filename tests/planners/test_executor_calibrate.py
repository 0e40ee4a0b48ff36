"""``hostmem calibrate``: real reads of real folders, a transfer: block the config parser takes."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch

from planners.cli import main
from planners.config import parse_config
from planners.executor.synthetic import write_synthetic_dit
from tests.conftest import run_python


def test_calibrate_times_a_folder_and_prints_a_transfer_block_the_config_takes(tmp_path, capsys):
    probe_dir = tmp_path / "root"
    probe_dir.mkdir()
    assert main(["calibrate", "--root", str(probe_dir), "--size", "8MiB"]) == 0
    out = capsys.readouterr().out
    assert os.listdir(probe_dir) == []  # the probe file is gone
    block = out[out.index("transfer:"):]
    assert "disk_read:" in block
    config = parse_config(
        "deployment: c\nworkload: {steps: 1}\ncomponents:\n  dit: {size: 1GiB, layers: 4, offload: layerwise}\n"
        + block, str(tmp_path / "c.yaml"), environ={})
    assert config.transfer.disk_read > 1e6
    if not torch.cuda.is_available():
        assert "need a GPU" in out and "pinned_h2d" not in block


def test_calibrate_reads_a_configs_checkpoint_as_it_is_and_reports_json(tmp_path, capsys):
    folder = tmp_path / "dit"
    folder.mkdir()
    path = write_synthetic_dit(folder / "model.safetensors", 4, 256, torch.float32)
    before = os.stat(path)
    (tmp_path / "deploy.yaml").write_text(
        "deployment: c\nworkload: {steps: 1}\ncomponents:\n"
        f"  dit: {{path: {folder}, layers: \"blocks.{{i}}.\", offload: layerwise}}\n"
    )
    assert main(["calibrate", str(tmp_path / "deploy.yaml"), "--root", str(tmp_path / "absent"), "--json",
                 "--size", f"{before.st_size}B"]) == 0
    result = json.loads(capsys.readouterr().out)
    (checkpoint,) = result["folders"]
    assert checkpoint["file"] == path and not checkpoint["probe"] and checkpoint["nbytes"] == before.st_size
    assert os.stat(path).st_mtime_ns == before.st_mtime_ns
    assert result["transfer"]["disk_read"] == checkpoint["disk_read"] > 0 and checkpoint["used_for_disk_read"]


def test_a_checkpoint_smaller_than_the_probe_is_never_the_disk_rate(tmp_path, capsys):
    """A 256 KiB file times a read's fixed costs, not the disk: a probe of the asked size is timed beside it."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "adapter.safetensors").write_bytes(os.urandom(256 << 10))
    assert main(["calibrate", "--path", str(folder), "--root", str(tmp_path / "absent"), "--size", "8MiB",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    small, probe = result["folders"]
    assert not small["probe"] and small["nbytes"] == 256 << 10 and not small["used_for_disk_read"]
    assert probe["probe"] and probe["nbytes"] == 8 << 20 and probe["used_for_disk_read"]
    assert result["transfer"]["disk_read"] == probe["disk_read"]
    assert any("256.0 KiB, too small to time the disk; timed a 8.0 MiB probe there instead" in n
               for n in result["notes"])
    assert sorted(os.listdir(folder)) == ["adapter.safetensors"]  # the probe is gone


def test_a_page_cache_slower_than_the_disk_is_explained():
    from planners.commands.calibrate import explain
    from planners.executor.rates import FolderRates

    odd = FolderRates("/srv/models", "/srv/models/a.safetensors", 1 << 30, disk_read=6.9e9, page_cache_read=5.1e9,
                      probe=False)
    fine = odd._replace(disk_read=2.1e9)
    (line,) = explain([odd, fine])
    assert line.startswith("/srv/models: the page cache read (") and "slower than the disk read" in line
    assert "a cache below this kernel" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_calibrate_asked_for_a_device_without_cuda_says_so_in_one_line(tmp_path, capsys):
    assert main(["calibrate", "--root", str(tmp_path), "--device", "cuda:0", "--size", "1MiB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA device" in err[0]


def test_the_readers_rate_reads_the_whole_file_and_leaves_none_of_it_cached(tmp_path):
    """``reader_rate``: the bound bench_executor judges a pass by. It times the executor's own
    reader over every layer of a real file, and drops its pages after."""
    from planners.executor.rates import reader_rate
    from tests.page_cache import cached_pages

    path = write_synthetic_dit(tmp_path / "model.safetensors", 4, 1024)  # 4 blocks of 2 MiB and more
    assert reader_rate(path, "parallel") > 1e6
    assert reader_rate(path, "read", nbytes=4 << 20) > 1e6
    assert not any(cached_pages(path))
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    from hostmem.errors import InputError

    with pytest.raises(InputError, match="empty file"):
        reader_rate(str(empty))


def test_a_probe_its_disk_has_no_room_for_is_refused_before_a_byte_is_written(small_filesystem, capsys):
    """A ``--size`` beyond the free space (a typo: 1TB) must not fill the disk a cache lives on."""
    assert main(["calibrate", "--root", small_filesystem, "--size", "1GiB"]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith(f"hostmem: error: {small_filesystem}: ")
    assert " MiB free, too little for the 1.0 GiB probe" in err
    assert "give a smaller --size (at most " in err and "--path DIR" in err
    assert os.listdir(small_filesystem) == ["lost+found"]  # nothing was written


PROBE_LIMITED = """
import resource, signal, sys
from planners.cli import main
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
resource.setrlimit(resource.RLIMIT_FSIZE, (20 << 20, 20 << 20))  # the probe fails a third of the way in
sys.exit(main(["calibrate", "--path", sys.argv[1], "--root", sys.argv[2], "--size", "64MiB"]))
"""


def test_a_probe_whose_write_fails_midway_is_removed_and_the_folder_named(tmp_path):
    folder = tmp_path / "disk"
    folder.mkdir()
    done = run_python(PROBE_LIMITED, str(folder), str(tmp_path / "absent"), timeout=60)
    assert done.returncode == 2, done.stderr
    (err,) = done.stderr.strip().splitlines()
    assert err.startswith(f"hostmem: error: {folder}: could not write the 64.0 MiB probe file")
    assert "File too large" in err
    assert os.listdir(folder) == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_calibrate_stopped_while_it_probes_removes_the_probe(tmp_path, signum):
    """Ctrl-C, or SIGTERM (a container's stop), while the probe is written or read: exit 130, one
    line, and no probe file left behind."""
    folder = tmp_path / "disk"
    folder.mkdir()
    command = [sys.executable, "-m", "planners.cli", "calibrate", "--path", str(folder), "--root",
               str(tmp_path / "absent"), "--size", "128MiB"]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while child.poll() is None and not os.listdir(folder):
        time.sleep(0.001)
    assert child.poll() is None, "the probe was never seen: the command ended first"
    child.send_signal(signum)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 130, err
    assert err.strip().splitlines() == ["hostmem calibrate: interrupted"]
    assert os.listdir(folder) == []


PROBE_BESIDE_LINKS = """
import os, sys
from planners.cli import main
folder, victim = sys.argv[1], sys.argv[2]
for name in (f".hostmem-calibrate-{os.getpid()}", ".hostmem-calibrate"):  # the names another user could guess
    os.symlink(victim, os.path.join(folder, name))
sys.exit(main(["calibrate", "--path", folder, "--root", sys.argv[3], "--size", "8MiB"]))
"""


def test_a_link_planted_where_calibrate_writes_its_probe_is_never_written_through(tmp_path):
    """Another user who may write the folder plants links under the names a probe could take:
    the file they point at is left as it was, and only the probe calibrate made is removed."""
    folder, victim = tmp_path / "shared", tmp_path / "precious"
    folder.mkdir()
    victim.write_bytes(b"someone's data")
    done = run_python(PROBE_BESIDE_LINKS, str(folder), str(victim), str(tmp_path / "absent"), timeout=60)
    assert done.returncode == 0, done.stderr
    assert victim.read_bytes() == b"someone's data"
    left = sorted(os.listdir(folder))
    assert len(left) == 2 and all(os.path.islink(folder / name) for name in left)


def test_a_probe_is_a_private_file_under_a_name_of_its_own(tmp_path):
    from planners.executor.rates import probe_file

    with probe_file(str(tmp_path), 1 << 20) as first, probe_file(str(tmp_path), 1 << 20) as second:
        assert first != second
        for path in (first, second):
            st = os.lstat(path)
            assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 1 << 20
    assert os.listdir(tmp_path) == []
