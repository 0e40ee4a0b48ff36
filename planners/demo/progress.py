"""Progress of the demo's long phases, in the units its summaries use.

Every phase that can take more than a couple of seconds shows something moving: the
files being written (a bar in bytes, shown as ``1.5 GiB / 4.0 GiB`` like every size the
demo prints), and each scenario's start (its anonymous memory as it grows, and the
seconds so far). Lines go to stderr, so ``--json`` output and the table stay clean.
"""

from __future__ import annotations

import sys

from tqdm import tqdm

from hostmem.units import format_size

__all__ = ["SizeBar", "StatusLine"]


class SizeBar(tqdm):
    """A bar counting bytes, its figures written by :func:`hostmem.units.format_size`."""

    def __init__(self, desc: str, total_bytes: int, enabled: bool = True):
        super().__init__(total=total_bytes, desc=desc, disable=not enabled, file=sys.stderr,
                         bar_format="{desc}: {percentage:3.0f}%|{bar:24}| {sizes} [{elapsed}<{remaining}]")

    @property
    def format_dict(self):
        figures = super().format_dict
        figures["sizes"] = f"{format_size(figures['n'])} / {format_size(figures['total'] or 0)}"
        return figures

    def update(self, n=1):
        if self.total is not None and self.n + n > self.total:  # the total was an estimate
            self.total = self.n + n
        return super().update(n)

    def close(self) -> None:
        """End at 100%: what was written is the total."""
        if not self.disable and self.total != self.n:
            self.total = self.n
            self.refresh()
        super().close()


class StatusLine(tqdm):
    """A bar-less line for work of unknown length; ``status`` says how far it got."""

    def __init__(self, desc: str, enabled: bool = True):
        self.status = ""
        super().__init__(desc=desc, disable=not enabled, file=sys.stderr, bar_format="{desc}: {status} [{elapsed}]")

    @property
    def format_dict(self):
        figures = super().format_dict
        figures["status"] = self.status
        return figures

    def show(self, status: str) -> None:
        self.status = status
        self.refresh()
