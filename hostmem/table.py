"""Aligned text tables: the one renderer every report of the project uses."""

from __future__ import annotations

__all__ = ["format_table"]


def format_table(rows: list[tuple], indent: str = "", right_from: int = 1) -> list[str]:
    """Lines of ``rows`` (the first is the header) in aligned columns.

    Columns before ``right_from`` are left-aligned (names), the rest right-aligned
    (numbers and sizes). Cells are turned into text with ``str``.
    """
    text = [[str(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in text if i < len(row)) for i in range(max(map(len, text)))]
    lines = []
    for row in text:
        cells = [c.ljust(w) if i < right_from else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append((indent + "  ".join(cells)).rstrip())
    return lines
