"""A small JSON record of the user's own (a calibration, a measured reserve), read with the
reason when it is not used: the plan says which file and why, not "none saved yet"."""

from __future__ import annotations

import json
import os

__all__ = ["read_own_json"]


def read_own_json(path: str) -> tuple[object | None, str | None]:
    """``(the parsed record, None)``; ``(None, None)`` where there is none yet; or ``(None,
    why)`` where it cannot be read, is not a plain file of this user's, or is no JSON."""
    from hostmem.vault.durable import read_small

    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"{path} cannot be read ({exc.strerror or exc})"
    if st.st_uid != os.geteuid() or not os.path.isfile(path):
        return None, f"{path} is not a file of this user's (uid {st.st_uid}); remove it"
    try:
        return json.loads(read_small(path)), None
    except (OSError, ValueError) as exc:
        return None, f"{path} cannot be read ({exc}); remove it"
