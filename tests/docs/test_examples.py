"""Every fenced example of README.md and docs/*.md runs as written (tests/docs/examples.py
says how each kind of block is checked), and a broken one fails."""

from __future__ import annotations

import gc
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("sybil", reason="the examples test needs sybil (pip install hostmem[test])")
pytest.importorskip("diffusers", reason="the examples load a tiny diffusers model (pip install hostmem[test])")
pytest.importorskip("peft", reason="the examples' adapters are written by peft (pip install hostmem[test])")

from hostmem.procfs import read_status  # noqa: E402
from tests.docs.doc_files import REPO, make_doc_files  # noqa: E402
from tests.docs.examples import run_page  # noqa: E402

PAGES = [Path(REPO, "README.md"), *sorted(Path(REPO, "docs").glob("*.md"))]


@pytest.fixture(scope="module")
def doc_files(tmp_path_factory):
    """The files the pages name, made once; each page runs in a copy of its own."""
    folder = tmp_path_factory.mktemp("doc-files")
    make_doc_files(str(folder))
    return folder


@pytest.fixture
def in_page_folder(doc_files, tmp_path, monkeypatch):
    """A fresh copy of the files as the current folder, with this checkout's `hostmem` first."""
    folder = tmp_path / "page"
    shutil.copytree(doc_files, folder)
    monkeypatch.chdir(folder)
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.setenv("PYTHONPATH", REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in [n for n in os.environ if n.startswith("HOSTMEM_")]:
        monkeypatch.delenv(name)
    return folder


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_example_of_the_page_runs(page, in_page_folder):
    locked = read_status().vm_lck
    run_page(page)
    gc.collect()  # what the page made is gone: so are its pins (later tests read VmLck)
    assert read_status().vm_lck == locked


def test_the_readme_fits_on_a_few_screens():
    assert len(Path(REPO, "README.md").read_text().splitlines()) < 250


BROKEN = {
    "an undefined name": "```python\nledger = hostmem.account({'dit': dit_module})\n```\n",
    "a command that fails": "```sh\nhostmem plan no-such-config.yaml\n```\n",
    "output that differs": "```sh\n$ hostmem --version\nhostmem 99.0\n```\n",
    "a doctest that differs": "```python\n>>> 1 + 1\n3\n```\n",
    "a command not the project's": "```sh\nrm -rf build\n```\n",
    "a config that does not load": "```yaml\ndeployment: x\nhost: {limit: 1.5}\n```\n",
    "a block without a language": "```\nhostmem plan x.yaml\n```\n",
}


@pytest.mark.parametrize("what", BROKEN)
def test_a_broken_example_fails(what, in_page_folder):
    page = in_page_folder / "broken.md"
    page.write_text(f"# A page\n\nSome text.\n\n{BROKEN[what]}")
    with pytest.raises(AssertionError):
        run_page(page)


def test_a_skipped_example_is_not_run_and_the_others_are(in_page_folder):
    page = in_page_folder / "skipped.md"
    page.write_text("It needs a GPU, so it is not run here:\n\n<!-- skip: next -->\n```python\nraise SystemExit(1)\n```\n\n"
                    "```python\nopen('ran', 'w').close()\n```\n")
    run_page(page)
    assert (in_page_folder / "ran").exists()


# Pages other changes add; a link to one may precede it, and must not once it is here.
ARRIVING = {"adapter-formats.md", "merge-policy.md", "security.md", "startup.md", "executor.md", "spill-and-pins.md"}
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """The anchor a markdown renderer gives a heading (GitHub's rule)."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in path.read_text().splitlines() if line.startswith("#")}


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_link_leads_somewhere(page):
    broken = []
    for target in _LINK.findall(page.read_text()):
        if "://" in target:
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            if path.name not in ARRIVING:
                broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(target)
    assert not broken, f"{page.name}: links to nothing: {broken}"
