"""Human units, parsed and printed in one place.

Every size that a person types ("32GiB", "18.4 G", "512MiB", "0", "4096") goes
through :func:`parse_size`; every size that a person reads goes through
:func:`format_size`. JSON carries plain integers of bytes and never passes here.

Binary suffixes (KiB, MiB, GiB, TiB, and the short K, M, G, T) are powers of 1024;
decimal suffixes (kB, MB, GB, TB) are powers of 1000, as disks and vendors count.
"""

from __future__ import annotations

import re

__all__ = ["parse_size", "format_size", "parse_rate", "format_rate", "parse_fraction"]

_MULTIPLIERS = {
    "": 1,
    "b": 1,
    "k": 1024, "ki": 1024, "kib": 1024,
    "m": 1024**2, "mi": 1024**2, "mib": 1024**2,
    "g": 1024**3, "gi": 1024**3, "gib": 1024**3,
    "t": 1024**4, "ti": 1024**4, "tib": 1024**4,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
}

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int | float) -> int:
    """Return the number of bytes that ``text`` names.

    Accepts plain integers, ``"4096"``, ``"512MiB"``, ``"32 GiB"``, ``"18.4G"`` and
    decimal units (``"61.7GB"``). Raises ``ValueError`` quoting the input when it is
    not a size.
    """
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r} (expected e.g. '32GiB', '512MiB' or bytes)")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"not a size: {text!r} (sizes are never negative)")
        return text
    if isinstance(text, float):
        if text < 0 or text != text:
            raise ValueError(f"not a size: {text!r} (sizes are never negative)")
        return int(round(text))
    if not isinstance(text, str):
        raise ValueError(f"not a size: {text!r} (expected e.g. '32GiB', '512MiB' or bytes)")
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (expected e.g. '32GiB', '512MiB', '61.7GB' or bytes)")
    number, unit = match.groups()
    multiplier = _MULTIPLIERS.get(unit.lower())
    if multiplier is None:
        raise ValueError(
            f"not a size: {text!r} (unknown unit {unit!r}; use B, KiB, MiB, GiB, TiB or kB, MB, GB, TB)"
        )
    return int(round(float(number) * multiplier))


def format_size(num_bytes: int | float, precision: int = 1) -> str:
    """Return ``num_bytes`` as a binary-unit string such as ``"18.4 GiB"``."""
    value = float(num_bytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{sign}{int(value)} B" if unit == "B" else f"{sign}{value:.{precision}f} {unit}"
        value /= 1024
    return f"{sign}{value:.{precision}f} TiB"


def parse_rate(text: str | int | float) -> float:
    """Return bytes per second for a rate such as ``"24GB/s"`` or ``"8 GiB/s"``."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text <= 0:
            raise ValueError(f"not a rate: {text!r} (a rate must be positive)")
        return float(text)
    if not isinstance(text, str) or not text.strip().endswith("/s"):
        raise ValueError(f"not a rate: {text!r} (expected e.g. '24GB/s' or '8GiB/s')")
    try:
        value = parse_size(text.strip()[:-2])
    except ValueError:
        raise ValueError(f"not a rate: {text!r} (expected e.g. '24GB/s' or '8GiB/s')") from None
    if value <= 0:
        raise ValueError(f"not a rate: {text!r} (a rate must be positive)")
    return float(value)


def format_rate(bytes_per_s: float) -> str:
    """Return a rate as ``"3.2 GiB/s"``."""
    return f"{format_size(bytes_per_s)}/s"


def parse_fraction(text: str | int | float) -> float:
    """Return a fraction in [0, 1] from ``"75%"`` or ``0.75``."""
    if isinstance(text, str):
        stripped = text.strip()
        try:
            value = float(stripped[:-1]) / 100 if stripped.endswith("%") else float(stripped)
        except ValueError:
            raise ValueError(f"not a fraction: {text!r} (expected e.g. '75%' or 0.75)") from None
    elif isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        raise ValueError(f"not a fraction: {text!r} (expected e.g. '75%' or 0.75)")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"not a fraction: {text!r} (must lie between 0% and 100%)")
    return value
