"""Shared fixtures: real safetensors files and real subprocesses."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch
from hostmem.safetensors.mapping import save_file


_RUN_TEMP = None  # this run's own temp folder: every temp file of the run lands in it


def pytest_configure(config):
    """Confine the run's temp files to one folder of its own, removed when the run ends.

    pytest's ``tmp_path`` folders, ``tempfile`` in this process, and every subprocess a
    test starts (they inherit ``TMPDIR``) all write under it; the default LoRA merge
    cache root (``HOSTMEM_CACHE_ROOT``) lives there too, so a merge that takes the
    default does not write into the user's home. Nothing of the run is left behind.
    """
    global _RUN_TEMP
    _interruptible()
    _exit_without_collection()
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    ours = os.environ.get("_HOSTMEM_TESTS_ROOT")
    if worker and ours and os.environ.get("HOSTMEM_CACHE_ROOT") == ours:
        # a worker of a parallel run (pytest -n): the run's folder is its TMPDIR already;
        # its own default cache root, so that no two workers' merges meet in one
        os.environ["HOSTMEM_CACHE_ROOT"] = ours + "-" + worker
    if _RUN_TEMP is not None or config.option.basetemp or worker:
        return
    _RUN_TEMP = tempfile.mkdtemp(prefix="hostmem-tests-")
    os.environ["TMPDIR"] = _RUN_TEMP
    tempfile.tempdir = _RUN_TEMP
    if "HOSTMEM_CACHE_ROOT" not in os.environ:
        os.environ["HOSTMEM_CACHE_ROOT"] = os.environ["_HOSTMEM_TESTS_ROOT"] = os.path.join(_RUN_TEMP, "cache-root")


_EXIT_SITE = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "exit_site"))


def _exit_without_collection() -> None:
    """Put ``tests/exit_site`` first on the ``PYTHONPATH`` every process a test starts
    inherits: its ``sitecustomize`` skips the interpreter's last collection at exit (a third
    of a second a process that imported torch, a sixth of the suite's time)."""
    os.environ["PYTHONPATH"] = os.pathsep.join([_EXIT_SITE, *_path_without_exit_site()])


def env_with_exit_collection() -> dict[str, str]:
    """This process's environment without ``tests/exit_site`` on ``PYTHONPATH``: a process
    started with it exits as a user's does, its last collection and the finalizers of
    objects in cycles included (what a test of a command's exit must see)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(_path_without_exit_site())}


def _path_without_exit_site() -> list[str]:
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.realpath(p) != _EXIT_SITE]


def _interruptible() -> None:
    """SIGINT, SIGQUIT and SIGHUP delivered as at a terminal, however the run was started: a shell
    starts a background job (``make test &``) with both ignored and ``nohup`` SIGHUP, which
    every process a test starts would inherit, and the tests of Ctrl-C and Ctrl-\\ (the guard,
    the demo) would then send them to processes that rightly ignore them. A handler (unlike
    an ignored signal) is reset to the default at exec, so children get SIGINT as from a
    terminal."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGQUIT, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)


def pytest_unconfigure(config):
    global _RUN_TEMP
    if _RUN_TEMP is not None:
        shutil.rmtree(_RUN_TEMP, ignore_errors=True)
        _RUN_TEMP = None


def write_safetensors(path, tensors: dict[str, torch.Tensor]) -> str:
    """Write ``tensors`` to ``path`` as a real safetensors file and return the path."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    save_file(tensors, path)
    return path


def mapped_model(model: torch.nn.Module, folder) -> torch.nn.Module:
    """``model`` with every weight a read-only mapped view of ``folder/base.safetensors``,
    written here from its own state dict (as a server loads a checkpoint)."""
    os.makedirs(folder, exist_ok=True)
    path = write_safetensors(os.path.join(folder, "base.safetensors"),
                             {k: v.detach().contiguous() for k, v in model.state_dict().items()})
    return map_into(model, path)


def map_into(model: torch.nn.Module, path) -> torch.nn.Module:
    """``model`` with each of its parameters that the safetensors file ``path`` holds a
    read-only mapped view of it (as a server loads a checkpoint)."""
    from hostmem.safetensors.mapping import load_readonly

    for name, tensor in load_readonly(path).items():
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
    return model


def drop_page_cache(path) -> None:
    """Ask the kernel to drop the file's cached pages (POSIX_FADV_DONTNEED)."""
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write_lora_config(folder, model, adapter, *, strength: float = 1.0, layers: str = "blocks.{i}.",
                      name: str = "lora-test") -> str:
    """A deployment config (``deploy.yaml`` in ``folder``) of one component at ``model``,
    streamed by ``layers``, with one adapter at ``strength`` and the cache at ``folder/cache``:
    what ``hostmem lora merge`` and ``planners.start`` read."""
    path = os.path.join(folder, "deploy.yaml")
    with open(path, "w") as handle:
        handle.write(textwrap.dedent(f"""\
            deployment: {name}
            host: {{limit: 8GiB, reserve: 1GiB}}
            workload: {{steps: 4}}
            components:
              dit: {{path: {model}, offload: layerwise, layers: "{layers}"}}
            lora:
              adapters: [{{path: {adapter}, strength: {strength}}}]
              cache: {{root: {os.path.join(folder, 'cache')}, enabled: true}}
            """))
    return path


def run_python(code: str, *args: str, timeout: float = 120, forked_from: tuple[str, ...] | None = None,
               **kwargs) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (this venv) and return the finished process.

    ``forked_from``: the libraries the child needs imported (``tests.fresh_fork.TORCH``,
    ``PRELOAD``): it is then forked from a server that imported them once
    (:func:`tests.fresh_fork.forked_python`; ``cwd`` and ``env`` are the only other
    arguments it takes), for a child whose process tree, peak memory, imports and exit
    are not what the test is about."""
    if forked_from is not None:
        from tests.fresh_fork import forked_python

        return forked_python(textwrap.dedent(code), *args, timeout=timeout, preload=forked_from, **kwargs)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


def vma_holding(address: int):
    """The mapping of this process that holds ``address`` (from /proc/self/smaps), or None."""
    from hostmem.procfs import read_smaps

    return next((v for v in read_smaps() if v.start <= address < v.end), None)


def transparent_huge_pages() -> str:
    """The kernel's THP mode ("always", "madvise", "never"), or "" where it has none."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as handle:
            return handle.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return ""


@pytest.fixture
def read_only_copy(tmp_path):
    """``read_only_copy(src)``: ``src`` bind-mounted read-only (skips where mounting is not allowed)."""
    mounts = []

    def mount(src: str) -> str:
        point = str(tmp_path / f"ro-{len(mounts)}")
        os.mkdir(point)
        done = subprocess.run(["mount", "--bind", "-o", "ro", src, point], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot bind-mount read-only here: {done.stderr.strip()}")
        mounts.append(point)
        return point

    yield mount
    for point in mounts:
        subprocess.run(["umount", point], capture_output=True)


@pytest.fixture
def small_filesystem(tmp_path):
    """A 16 MiB ext4 filesystem loop-mounted for the test, its mount point (skips where mounting
    is not allowed): a real full disk, the kernel's own ENOSPC.

    Its own bookkeeping (the journal above all) takes a share that differs with mkfs's
    version: at 8 MiB, one machine left 3.3 MiB of it free, too little for a 4 MiB layer
    to start writing."""
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4") or not shutil.which("mount"):
        pytest.skip("needs root, mkfs.ext4 and mount to make a small filesystem")
    image, point = tmp_path / "fs.img", tmp_path / "mnt"
    point.mkdir()
    with open(image, "wb") as handle:
        handle.truncate(16 << 20)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], capture_output=True, text=True)
    mounted = made.returncode == 0 and subprocess.run(
        ["mount", "-o", "loop", str(image), str(point)], capture_output=True, text=True
    ).returncode == 0
    if not mounted:
        pytest.skip("cannot loop-mount a filesystem here")
    try:
        yield str(point)
    finally:
        subprocess.run(["umount", str(point)], capture_output=True)


@pytest.fixture
def st_file(tmp_path):
    """A factory: ``st_file(name, tensors)`` writes a safetensors file under tmp_path."""

    def make(name: str, tensors: dict[str, torch.Tensor]) -> str:
        return write_safetensors(tmp_path / name, tensors)

    return make
