"""A start sweeps the temporaries of a memo whose writer was killed at the root, too.

Memos written beside the cache (``kernel_wisdom.json`` at the root) go through the
same durable write as the cache's own files, so a writer SIGKILLed in the middle
leaves ``.tmp-PID-XXXXXXXX`` at the root; the next start removes it (its lock is
free), and leaves alone what is not ours or still held.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from hostmem.vault import Vault
from tests.faults.test_sweep_liveness import kill_group

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# Opens a memo's temporary at the root as durable_write does, half writes it, then waits to be killed.
WRITER = """
import sys
from hostmem.vault.durable import open_tmp, write_all
fd, path = open_tmp(sys.argv[1])
write_all(fd, b'{"files": {' * 100, 0)
print(path, flush=True)
sys.stdin.read()
"""


def _writer(root: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, root], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True)
    path = proc.stdout.readline().strip()
    assert path, "the writer did not start"
    return proc, path


def test_a_start_sweeps_a_killed_memo_writers_temporary_at_the_root(tmp_path):
    root = tmp_path / "root"
    Vault(root)  # the root and its cache exist, as after any earlier start
    proc, held = _writer(str(root))
    try:
        Vault(root)
        assert os.path.exists(held), "a live writer's temporary was taken"
    finally:
        kill_group(proc)
    foreign = root / ".tmp-notes"  # not a name durable_write makes: someone else's
    foreign.write_text("mine")
    deadline = time.monotonic() + 10
    while os.path.exists(held) and time.monotonic() < deadline:  # descriptors close as the process is torn down
        Vault(root)
        time.sleep(0.05)
    assert not os.path.exists(held)
    assert sorted(os.listdir(root)) == [".tmp-notes", "lora_merge_cache"]
