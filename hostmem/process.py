"""The residency of a whole process, per mapping and in total (``hostmem inspect``).

Reads /proc only, so it needs no cooperation from the process. The JSON form is a
contract other tools parse::

    {"pid": int,
     "totals": {"anonymous": B, "file_backed": B, "shmem": B, "pinned": B,
                "swapped": B, "not_resident": B, "non_reclaimable": B},
     "mappings": [{"path": str | null, "start": int, "end": int, ...same class keys...}],
     "precision": "page" | "vma"}

Every size is bytes. Keys may be added, never renamed. Classifying whole areas needs
no torch (:class:`hostmem.areas.AreaSnapshot`), so ``hostmem inspect`` starts fast.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .areas import AreaSnapshot
from .procfs import ProcReadError
from .procfs.stat import read_stat
from .residency_classes import Residency
from .table import format_table
from .units import format_size

__all__ = ["MappingResidency", "ProcessResidency", "inspect_process", "require_process"]


def require_process(pid: int) -> None:
    """Raise :class:`ProcReadError` unless ``pid`` names a live user process: "no such
    process", or what it is instead (a zombie, a kernel thread), neither of which has
    memory to measure."""
    gone = ProcReadError(f"pid {pid}: no such process (it may have exited; list processes with `ps`)")
    if pid <= 0:
        raise gone
    try:
        found = read_stat(pid)
    except (FileNotFoundError, ProcessLookupError):
        raise gone from None
    except OSError:
        return  # unreadable here: the files read next say why
    if found.exited:
        raise ProcReadError(f"pid {pid}: has exited, and its parent has not reaped it yet (a zombie): "
                            "it holds no memory to measure")
    if found.kernel_thread:
        raise ProcReadError(f"pid {pid}: a kernel thread: it has no user memory to measure")


@dataclass(frozen=True)
class MappingResidency:
    path: str | None
    start: int
    end: int
    perms: str
    residency: Residency


@dataclass(frozen=True)
class ProcessResidency:
    pid: int
    mappings: list[MappingResidency]
    precision: str

    @property
    def totals(self) -> Residency:
        total = Residency()
        for mapping in self.mappings:
            total = total + mapping.residency
        return total

    def by_path(self) -> dict[str, Residency]:
        """Residency summed per mapping path (anonymous areas under ``[anon]``)."""
        out: dict[str, Residency] = {}
        for mapping in self.mappings:
            key = mapping.path or "[anon]"
            out[key] = out.get(key, Residency()) + mapping.residency
        return out

    def to_dict(self) -> dict:
        return {
            "pid": self.pid,
            "totals": self.totals.to_dict(),
            "mappings": [
                {"path": m.path, "start": m.start, "end": m.end, "perms": m.perms, **m.residency.to_dict()}
                for m in self.mappings
            ],
            "precision": self.precision,
        }

    def to_text(self, top: int = 10) -> str:
        totals = self.totals
        lines = [
            f"pid {self.pid}: non-reclaimable {format_size(totals.non_reclaimable)} "
            f"(anonymous {format_size(totals.anonymous)}, shmem {format_size(totals.shmem)}, "
            f"pinned {format_size(totals.pinned)})",
            f"  file-backed {format_size(totals.file_backed)}, swapped {format_size(totals.swapped)}, "
            f"not resident {format_size(totals.not_resident)}; precision: {self.precision}",
            "",
        ]
        ranked = sorted(self.by_path().items(), key=lambda kv: (-kv[1].non_reclaimable, -kv[1].resident))
        rows = [("mapping", "non-recl.", "anonymous", "file-backed", "shmem", "pinned")]
        for path, r in ranked[: top if top > 0 else None]:
            rows.append(
                (
                    path,
                    format_size(r.non_reclaimable),
                    format_size(r.anonymous),
                    format_size(r.file_backed),
                    format_size(r.shmem),
                    format_size(r.pinned),
                )
            )
        lines.extend(format_table(rows))
        if top > 0 and len(ranked) > top:
            lines.append(f"... {len(ranked) - top} more mappings (--top 0 shows all)")
        return "\n".join(lines)


def inspect_process(pid: int | None = None) -> ProcessResidency:
    """Classify every mapping of process ``pid`` (default: this one).

    Raises :class:`ProcReadError` saying "no such process" when ``pid`` names none,
    rather than naming whichever /proc file happened to be read first.
    """
    if pid is not None:
        require_process(pid)
    try:
        with AreaSnapshot(pid) as areas:  # whole areas only: no torch, a byte count per area
            mappings = [MappingResidency(v.path, v.start, v.end, v.perms, areas.classify_whole_area(v))
                        for v in areas.vmas]
            precision = areas.precision
    except ProcReadError:
        if pid is not None:
            require_process(pid)  # it exited while it was read: say that, not which file failed
        raise
    return ProcessResidency(pid=os.getpid() if pid is None else pid, mappings=mappings, precision=precision)
