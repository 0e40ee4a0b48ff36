"""The formats table of docs/adapter-formats.md is the corpus's, generated: never stale."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_formats_table_is_generated_from_the_corpus():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "docs", "gen_adapter_formats.py"), "--check"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_stale_table_is_told():
    sys.path.insert(0, os.path.join(ROOT, "docs"))
    try:
        import gen_adapter_formats as gen
    finally:
        sys.path.remove(os.path.join(ROOT, "docs"))
    page = f"intro\n{gen.BEGIN}\n| old | table |\n{gen.END}\nafter\n"
    fresh = gen.rendered(page)
    assert fresh != page and fresh.startswith("intro\n") and fresh.endswith(f"{gen.END}\nafter\n")
    assert gen.rendered(fresh) == fresh
