"""Build a LoRA merge cache, and die on cue: the faults suite's child.

``python tests/faults/driver.py BASE ADAPTER ROOT`` merges ADAPTER into the mapped
checkpoint BASE through the cache under ROOT, like ``hostmem lora merge``, and prints
how many writes, fsyncs and renames it made (``calls N``).

``python tests/faults/driver.py BASE ADAPTER ROOT N1 N2 ...`` forks one build per N
(into ``ROOT-N``), each of which sends itself SIGKILL just before its Nth write, fsync
or rename, whichever phase of the build that falls in (layer data, the content-hash
memo, the kernel timings, the verification memo, the manifest, the folder fsyncs): a
real crash of a real process, with the kernel's real state of every file. Forking
spares each build the interpreter's start; it prints ``N killed`` or ``N exited S``.
"""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_CALLS = 0
_KILL_AT = 0


def _on_cue(call):
    def wrapped(*args, **kwargs):
        global _CALLS
        _CALLS += 1
        if _CALLS == _KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        return call(*args, **kwargs)

    return wrapped


for _name in ("write", "pwrite", "fsync", "rename", "replace"):
    setattr(os, _name, _on_cue(getattr(os, _name)))

import lora_cache  # noqa: E402  (after the cue is set: nothing of the vault may write before it)
from lora_cache.placement.layers import checkpoint_module  # noqa: E402


def build(base: str, adapter: str, root: str):
    return lora_cache.merge(checkpoint_module([base]), [adapter], cache_root=root, progress=False)


def killed_at(base: str, adapter: str, root: str, kill_at: int) -> str:
    """Build in a forked child that dies at its ``kill_at``-th call; how it ended."""
    pid = os.fork()
    if pid == 0:
        global _KILL_AT
        _KILL_AT = kill_at
        try:
            build(base, adapter, root)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return "killed"
    return f"exited {os.waitstatus_to_exitcode(status)}"


if __name__ == "__main__":
    base, adapter, root, *kills = sys.argv[1:]
    if not kills:
        stats = build(base, adapter, root)
        print(f"built {stats.built} hit {stats.hit}")
        print(f"calls {_CALLS}")
    for n in map(int, kills):
        print(f"{n} {killed_at(base, adapter, f'{root}-{n}', n)}", flush=True)
