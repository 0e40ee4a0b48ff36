"""Why a checkpoint path that is neither a regular file nor a folder names no checkpoint."""

from __future__ import annotations

import os

__all__ = ["missing_or_not_regular"]


def missing_or_not_regular(path: str) -> str:
    """``"no such file or folder"``, or, where ``path`` exists (a FIFO, socket or device), what to name instead."""
    if os.path.exists(path):
        return "not a regular file or folder (a FIFO, socket or device); name the checkpoint's file or folder"
    return "no such file or folder"
