"""Kernel timings remembered per machine, the way FFTW keeps its wisdom.

Which kernel sums a layer fastest depends on the CPU (torch's bf16 addmm is several
times faster than the fp32 sum with AVX512-BF16 or AMX, several times slower with AVX2
alone), on torch's version, the dtype, the layer's shape and the threads. So a choice
is measured once and remembered under that whole description: in
``<root>/kernel_wisdom.json`` beside the cache, and in this process. The cache key
names the kernel, so the choice must stick: once a class is recorded, every later
merge on that machine reads it instead of timing again, and two processes that time
at once agree through a lock (the first to record wins). The file steers which sum
the merge runs (a fact that says bf16 addmm rounds once where it does not would merge
wrong weights), so it is trusted as the cache's own files are: a regular file of this
user's, in a root only this user can write, never read or locked through a link; any
other is set aside with a warning and the kernels are timed in this process. Beside the timings
(:data:`ENTRIES`) the file keeps facts about the machine's kernels (:data:`FACTS`, such
as whether torch's bf16 addmm rounds once), which cost a start milliseconds to learn.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import threading
import warnings

import torch

from hostmem.vault.durable import durable_write
from hostmem.vault.locks import describe_holders, flock_within, lock_holders
from hostmem.vault.safety import VaultError, check_root, open_trusted, read_trusted

from .precision import instruction_caps

__all__ = ["ENTRIES", "FACTS", "WISDOM_FILE", "Wisdom", "machine"]

WISDOM_FILE = "kernel_wisdom.json"
_VERSION = 1
ENTRIES = "entries"  # the file's section of kernel timings and choices
FACTS = "facts"  # the file's section of facts learned about the kernels
# The CPU flags that decide which matrix kernels torch can use for bf16 and fp32.
_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "asimd", "bf16", "sve")
_MEMORY: dict[tuple[str, str], dict] = {}  # (section, key) -> entry: this process's wisdom, whatever the root
_MEMORY_LOCK = threading.Lock()


@functools.cache
def machine() -> dict:
    """The CPU model and the flags that matter, the CPU count and torch's version."""
    info: dict[str, str] = {}
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                name, _, value = line.partition(":")
                info.setdefault(name.strip(), value.strip())  # the first CPU's
    model = info.get("model name") or info.get("Model") or platform.processor() or platform.machine()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    return {"cpu": model, "flags": [f for f in _FLAGS if f in flags], "cpus": os.cpu_count(),
            "torch": torch.__version__}


def entry_key(dtype: str, shape_class: str, threads: int) -> str:
    """The description a timing is remembered under (one JSON string): the machine's, the
    layer's, and the instruction caps set in the environment where there are any
    (:func:`~lora_cache.kernels.precision.instruction_caps`)."""
    m, caps = machine(), instruction_caps()
    return json.dumps([m["cpu"], m["flags"], m["torch"], dtype, shape_class, threads, *([caps] if caps else [])],
                      separators=(",", ":"))


class Wisdom:
    """Remembered kernel choices: in ``root`` (a cache root) when given, else in this process only."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.path = None if root is None else os.path.join(os.path.expanduser(os.fspath(root)), WISDOM_FILE)
        self.writable = False

    def recall(self, key: str, section: str = ENTRIES) -> dict | None:
        """The entry remembered for ``key``: the file's (with a root), else this process's."""
        if self.path is not None:
            return self._read(section).get(key)
        with _MEMORY_LOCK:
            return _MEMORY.get((section, key))

    @contextlib.contextmanager
    def recording(self, section: str = ENTRIES):
        """Hold the lock while timing and recording, so concurrent processes agree.

        Yields ``record(key, measure) -> entry``: the entry that stands for ``key`` in
        ``section`` (the file's, else this process's, else what ``measure()`` returns,
        which is then kept in both), so a choice once made is the one every later merge uses.
        """
        with self._locked():
            sections = self._sections() if self.path is not None else {}
            known = sections.get(section, {})
            added: dict[str, dict] = {}

            def record(key: str, measure) -> dict:
                if key in known:
                    standing = known[key]
                else:
                    with _MEMORY_LOCK:
                        standing = _MEMORY.get((section, key))
                    standing = standing or measure()
                    added[key] = standing
                with _MEMORY_LOCK:
                    _MEMORY[(section, key)] = standing
                return standing

            yield record
            if added and self.path is not None and self.writable:
                self._write({**sections, section: {**known, **added}})

    @contextlib.contextmanager
    def _locked(self):
        """The root's wisdom lock; a root that cannot be written (a read-only image) is read
        but not written, and its new choices stay in this process (as they do where the
        root or the lock is not one the cache may trust: said once, as a warning)."""
        self.writable = False
        if self.path is None:
            yield
            return
        try:
            os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
            check_root(os.path.dirname(self.path))
            fd = open_trusted(self.path + ".lock", os.O_RDWR | os.O_CREAT)
        except VaultError as refused:
            _warn_untrusted(refused)
            yield
            return
        except OSError:
            yield
            return
        try:
            self.writable = _lock_within(fd, self.path + ".lock")
            yield
        finally:
            os.close(fd)  # releases the lock

    def _read(self, section: str = ENTRIES) -> dict:
        """One section of the file: ``{key: entry}`` (empty where the file has none)."""
        return self._sections().get(section, {})

    def _sections(self) -> dict:
        """The file's sections (:data:`ENTRIES`, :data:`FACTS`), each ``{key: entry}``, an
        entry a dict; a file of another version, unreadable, or not trusted, holds none."""
        try:
            check_root(os.path.dirname(self.path))
            data = json.loads(read_trusted(self.path))
        except FileNotFoundError:
            return {}
        except VaultError as refused:
            _warn_untrusted(refused)
            return {}
        except (OSError, ValueError) as error:
            warnings.warn(f"{self.path}: unreadable kernel wisdom ({error}); timing the kernels again. "
                          "Delete the file to stop this warning.")
            return {}
        if not isinstance(data, dict) or data.get("version") != _VERSION or not isinstance(data.get(ENTRIES), dict):
            return {}
        return {name: {k: v for k, v in data[name].items() if isinstance(v, dict)}
                for name in (ENTRIES, FACTS) if isinstance(data.get(name), dict)}

    def _write(self, sections: dict) -> None:
        """Replace the file atomically: a reader sees the old wisdom or the new, never a torn one."""
        text = json.dumps({"version": _VERSION, ENTRIES: {}, **sections}, indent=1, sort_keys=True)
        durable_write(self.path, text.encode())


def _lock_within(fd: int, path: str) -> bool:
    """Take the wisdom lock within a bounded wait (:func:`~hostmem.vault.locks.flock_within`);
    False, with a warning naming who holds it, when it is still held then: the kernels
    are timed in this process and nothing is written."""
    if flock_within(fd, path):
        return True
    warnings.warn(f"kernel wisdom not recorded: its lock {path} is held by {describe_holders(lock_holders(path))} "
                  "past the wait (HOSTMEM_LOCK_TIMEOUT); the kernels are timed in this process. Make the cache root "
                  "private (`chmod -R go-rwx` on it) so that nobody else can open its lock.", stacklevel=4)
    return False


def _warn_untrusted(refused: VaultError) -> None:
    """Say that the root's wisdom is not used, and why (Python shows a warning once)."""
    warnings.warn(f"kernel wisdom not used: {refused} Until then the kernels are timed in this process.",
                  stacklevel=3)
