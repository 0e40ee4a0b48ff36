"""The order a component's layers run in, as last seen: what the read-ahead follows.

Servers do not run the plan's list: step caching skips the middle blocks on most
steps, CFG runs a pass twice, a pass may stop halfway. So the read-ahead does not walk
the plan's order but the order seen: which layer followed which, the last time each
ran (across pass boundaries, so the next pass's first layers are read while the last
ones compute), starting from the plan's order until a layer has been seen. A layer run
twice in a row teaches nothing (it would point the read-ahead at itself).
"""

from __future__ import annotations

from typing import Callable, Sequence

__all__ = ["LearnedOrder"]


class LearnedOrder:
    """Which layer follows which (the plan's order until seen otherwise), and where a pass ends."""

    def __init__(self, order: Sequence[str]):
        order = list(order)
        self.following = dict(zip(order, order[1:] + order[:1]))
        self.first = order[0] if order else None  # the first layer of the last pass
        self.end = order[-1] if order else None  # the last layer of the last pass
        self.last: str | None = None
        self._starting = False

    def begin_pass(self) -> None:
        self._starting = True

    def end_pass(self) -> None:
        if self.last is not None and not self._starting:
            self.end = self.last

    def seen(self, name: str) -> None:
        """``name`` runs now."""
        if self._starting:
            self.first, self._starting = name, False
        if self.last is not None and self.last != name:
            self.following[self.last] = name
        self.last = name

    def ahead(self, name: str | None, wanted: Callable[[str], bool], count: int, include: bool = False,
              size: Callable[[str], int] | None = None, budget: int | None = None) -> tuple[list[str], int]:
        """Up to ``count`` layers that follow ``name`` (``name`` too with ``include``), each once, that
        ``wanted``, and no more than ``budget`` bytes of them by ``size`` past the first (the window
        the plan made room for: always the next layer); and how many of them come before the end
        of the pass (as last seen)."""
        out, at, visited, in_pass, taken = [], name, set(), None, 0
        if include and name is not None and count and wanted(name):
            out.append(name)
        while at is not None and len(out) < count:
            visited.add(at)
            if at == self.end and in_pass is None:
                in_pass = len(out)
            at = self.following.get(at)
            if at is None or at in visited:
                break
            if wanted(at):
                taken += size(at) if size is not None else 0
                if out and budget is not None and taken > budget:
                    break
                out.append(at)
        return out, len(out) if in_pass is None else in_pass
