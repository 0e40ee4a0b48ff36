"""Page spans: the whole pages under tensors, and the interval arithmetic a pinner's books need.

A pinner locks whole pages, and two tensors (or two layers) may share one, so its
books are sets of page ranges: merged, subtracted and intersected here, apart from
the backends that lock them.
"""

from __future__ import annotations

import torch

from .procfs import PAGE_SIZE

__all__ = ["page_span", "spans_of", "merge_spans", "subtract_spans", "intersect_spans", "total_of"]


def page_span(tensor: torch.Tensor) -> tuple[int, int]:
    """``(start, end)`` of the whole pages under the tensor's storage."""
    storage = tensor.untyped_storage()
    start = storage.data_ptr()
    end = start + storage.nbytes()
    return start - start % PAGE_SIZE, end + (-end) % PAGE_SIZE


def merge_spans(spans) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out if e > s]


def subtract_spans(spans, minus) -> list[tuple[int, int]]:
    out, minus = [], merge_spans(minus)
    for start, end in merge_spans(spans):
        cursor = start
        for m_start, m_end in minus:
            if m_end <= cursor or m_start >= end:
                continue
            if m_start > cursor:
                out.append((cursor, m_start))
            cursor = max(cursor, m_end)
        if cursor < end:
            out.append((cursor, end))
    return out


def intersect_spans(spans, other) -> list[tuple[int, int]]:
    return subtract_spans(spans, subtract_spans(spans, other))


def total_of(spans) -> int:
    return sum(e - s for s, e in spans)


def spans_of(tensors) -> list[tuple[int, int]]:
    return merge_spans(page_span(t) for t in tensors if t.untyped_storage().nbytes())
