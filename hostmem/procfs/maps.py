"""Virtual memory areas of a process: /proc/PID/maps (ranges, permissions, paths) and
/proc/PID/smaps (the same with resident, anonymous, locked and swapped bytes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .files import proc_path, read_text

__all__ = ["Vma", "locked_within", "parse_maps_line", "read_maps", "read_smaps", "strip_deleted"]


def strip_deleted(path: str) -> str:
    """A mapped file's path without the `` (deleted)`` maps appends once it is unlinked."""
    return path[: -len(" (deleted)")] if path.endswith(" (deleted)") else path


@dataclass(frozen=True)
class Vma:
    """One virtual memory area from /proc/PID/smaps. Sizes are bytes."""

    start: int
    end: int
    perms: str
    offset: int
    inode: int
    path: str | None
    rss: int = 0
    anonymous: int = 0
    locked: int = 0
    swap: int = 0
    anon_huge_pages: int = 0  # of ``anonymous``, what transparent huge pages hold
    shmem_pmd_mapped: int = 0
    private_dirty: int = 0
    vm_flags: frozenset = field(default_factory=frozenset)

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def is_shared(self) -> bool:
        """True for MAP_SHARED areas ('s' in the permissions)."""
        return self.perms[3:4] == "s"

    @property
    def is_locked(self) -> bool:
        """True when the area is mlocked (VmFlags ``lo``)."""
        return "lo" in self.vm_flags

    @property
    def is_file(self) -> bool:
        """True when the area maps a file (an inode), not anonymous memory."""
        return self.inode != 0


_SMAPS_FIELDS = {
    "Rss": "rss",
    "Anonymous": "anonymous",
    "Locked": "locked",
    "Swap": "swap",
    "AnonHugePages": "anon_huge_pages",
    "ShmemPmdMapped": "shmem_pmd_mapped",
    "Private_Dirty": "private_dirty",
}


def _parse_vma_header(line: str) -> dict:
    parts = line.split(None, 5)
    start, end = (int(x, 16) for x in parts[0].split("-"))
    path = parts[5].strip() if len(parts) > 5 else None
    return {
        "start": start,
        "end": end,
        "perms": parts[1],
        "offset": int(parts[2], 16),
        "inode": int(parts[4]),
        "path": path or None,
    }


def parse_maps_line(line: str) -> Vma:
    """One line of /proc/PID/maps as a :class:`Vma` (ranges, permissions, path)."""
    return Vma(**_parse_vma_header(line))


def read_maps(pid: int | None = None) -> list[Vma]:
    """Return every VMA of the process from /proc/PID/maps: ranges, permissions, paths.

    Much cheaper than smaps (the kernel does not walk the pages to count Rss), but
    without counters or VmFlags.
    """
    path = proc_path(pid, "maps")
    return [parse_maps_line(line) for line in read_text(path).splitlines() if line]


def read_smaps(pid: int | None = None) -> list[Vma]:
    """Return every VMA of the process with its smaps fields, in address order."""
    path = proc_path(pid, "smaps")
    vmas: list[Vma] = []
    current: dict | None = None
    for line in read_text(path).splitlines():
        head = line.split(":", 1)[0]
        if head == "VmFlags":
            if current is not None:
                current["vm_flags"] = frozenset(line.split(":", 1)[1].split())
        elif ":" in line and " " not in head and head[:1].isalpha() and not _looks_like_range(head):
            key = _SMAPS_FIELDS.get(head)
            if key is not None and current is not None:
                current[key] = int(line.split()[1]) * 1024
        else:
            if current is not None:
                vmas.append(Vma(**current))
            current = _parse_vma_header(line)
    if current is not None:
        vmas.append(Vma(**current))
    return vmas


def locked_within(spans, pid: int | None = None) -> int:
    """Bytes of ``spans`` (``(start, end)`` addresses, none overlapping another) that lie in
    memory the kernel holds locked: VMAs whose smaps ``VmFlags`` have ``lo`` (mlock splits a
    VMA at the edges of what it locks). Unlike the growth of ``VmLck``, what the rest of the
    process locks or unlocks meanwhile does not change it."""
    locked = [(vma.start, vma.end) for vma in read_smaps(pid) if "lo" in vma.vm_flags]
    total, i = 0, 0
    for start, end in sorted(spans):
        while i < len(locked) and locked[i][1] <= start:
            i += 1
        j = i
        while j < len(locked) and locked[j][0] < end:
            total += min(end, locked[j][1]) - max(start, locked[j][0])
            j += 1
    return total


def _looks_like_range(token: str) -> bool:
    return "-" in token and all(c in "0123456789abcdef-" for c in token)
