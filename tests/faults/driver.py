"""Build a LoRA merge cache, and die on cue: the faults suite's child.

``python tests/faults/driver.py BASE ADAPTER ROOT`` merges ADAPTER into the mapped
checkpoint BASE through the cache under ROOT, like ``hostmem lora merge``, and prints
how many writes, fsyncs and renames it made (``calls N``), and the first of them made on
the seal's thread (``seal thread from N``, 0 for none).

``python tests/faults/driver.py [--behind=hashed|folded] BASE ADAPTER ROOT N1 N2 ...`` forks one build per N
(into ``ROOT-N``), each of which sends itself SIGKILL just before its Nth write, fsync
or rename, whichever phase of the build that falls in (layer data, the content-hash
memo, the kernel timings, the verification memo, the manifest, the folder fsyncs): a
real crash of a real process, with the kernel's real state of every file. Forking
spares each build the interpreter's start; it prints ``N killed`` or ``N exited S``.

``--behind=hashed``: each root first remembers the page cache as the faster way to write
and knows the base's digest (calls not counted), so the build is sealed behind its start
(:mod:`hostmem.vault.behind`): its layers' fsyncs and renames, the manifest and the
folder's fsync run on the seal's thread, which the build waits for before it exits.
``--behind=folded``: the same on a base not hashed yet, so the build folds the hash
(:mod:`hostmem.vault.fold`) and its re-key runs on the seal's thread too.
"""

import os
import signal
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_CALLS = 0
_KILL_AT = 0
_SEAL_THREAD_FROM = 0  # the first call made on the seal's thread (hostmem.vault.behind)


def _on_cue(call):
    def wrapped(*args, **kwargs):
        global _CALLS, _SEAL_THREAD_FROM
        _CALLS += 1
        if not _SEAL_THREAD_FROM and threading.current_thread().name == "hostmem-vault-seal":
            _SEAL_THREAD_FROM = _CALLS
        if _CALLS == _KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        return call(*args, **kwargs)

    return wrapped


for _name in ("write", "pwrite", "fsync", "rename", "replace"):
    setattr(os, _name, _on_cue(getattr(os, _name)))

import lora_cache  # noqa: E402  (after the cue is set: nothing of the vault may write before it)
from lora_cache.placement.layers import checkpoint_module  # noqa: E402


_BEHIND = ""


def build(base: str, adapter: str, root: str):
    global _CALLS
    if _BEHIND:
        from hostmem.vault import Vault
        from tests.lora_cache.test_write_way import _remember

        _remember(root, "buffered")
        if _BEHIND == "hashed":
            Vault(root).base_identity([base])
        _CALLS = 0  # the kill points are the build's own
    stats = lora_cache.merge(checkpoint_module([base]), [adapter], cache_root=root, progress=False)
    lora_cache.wait_sealed()
    return stats


def killed_at(base: str, adapter: str, root: str, kill_at: int) -> str:
    """Build in a forked child that dies at its ``kill_at``-th call; how it ended."""
    pid = os.fork()
    if pid == 0:
        global _KILL_AT, _CALLS
        _KILL_AT, _CALLS = kill_at, 0
        try:
            build(base, adapter, root)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return "killed"
    return f"exited {os.waitstatus_to_exitcode(status)}"


if __name__ == "__main__":
    _BEHIND = sys.argv[1].removeprefix("--behind=") if sys.argv[1].startswith("--behind=") else ""
    base, adapter, root, *kills = sys.argv[1 + bool(_BEHIND):]
    if not kills:
        stats = build(base, adapter, root)
        print(f"built {stats.built} hit {stats.hit} behind {stats.sealed_behind}")
        print(f"seal thread from {_SEAL_THREAD_FROM}")
        print(f"calls {_CALLS}")
    for n in map(int, kills):
        print(f"{n} {killed_at(base, adapter, f'{root}-{n}', n)}", flush=True)
