"""Human units, parsed and printed in one place.

Every size that a person types ("32GiB", "18.4 G", "512MiB", "0", "4096") goes
through :func:`parse_size`; every size that a person reads goes through
:func:`format_size`. JSON carries plain integers of bytes and never passes here.

Binary suffixes (KiB, MiB, GiB, TiB, PiB, EiB, and the short K, M, G, T, P, E) are powers
of 1024; decimal suffixes (kB, MB, GB, TB, PB, EB) are powers of 1000, as disks and vendors
count. What :func:`format_size` prints, :func:`parse_size` reads back, to within half of
its last digit, the largest size (``8.0 EiB``) included.
"""

from __future__ import annotations

import re

from .errors import InputError

__all__ = ["parse_size", "size_option", "MAX_SIZE", "FLOAT32_MAX", "format_size", "parse_rate", "format_rate", "parse_fraction"]

_MULTIPLIERS = {
    "": 1,
    "b": 1,
    "k": 1024, "ki": 1024, "kib": 1024,
    "m": 1024**2, "mi": 1024**2, "mib": 1024**2,
    "g": 1024**3, "gi": 1024**3, "gib": 1024**3,
    "t": 1024**4, "ti": 1024**4, "tib": 1024**4,
    "p": 1024**5, "pi": 1024**5, "pib": 1024**5,
    "e": 1024**6, "ei": 1024**6, "eib": 1024**6,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4, "pb": 1000**5, "eb": 1000**6,
}

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")
_DIGITS_MAX = 30  # more digits than any size can have: refused before float() sees them
# The largest size accepted: offsets in safetensors and /proc are 64-bit, and a larger
# figure in a config is a typo that would overflow the plan's arithmetic downstream.
MAX_SIZE = (1 << 63) - 1
# the largest float32: a LoRA scale beyond it cannot be computed in the float32 the merge sums in
FLOAT32_MAX = 3.4028234663852886e38
_EXAMPLES = "expected e.g. '32GiB', '512MiB', '61.7GB' or a whole number of bytes"


def parse_size(text: str | int | float) -> int:
    """Return the number of bytes that ``text`` names.

    Accepts whole numbers of bytes (``4096``, ``"4096"``), ``"512MiB"``, ``"32 GiB"``,
    ``"18.4G"`` and decimal units (``"61.7GB"``). A fraction without a unit (``"1.5"``)
    is refused rather than rounded to 2 bytes: it is almost always a size whose unit
    was forgotten. Raises ``ValueError`` quoting the input when it is not a size, is
    negative, not finite, or larger than :data:`MAX_SIZE`.
    """
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise InputError(f"not a size: {_quote(text)} ({_EXAMPLES})")
    if isinstance(text, int):
        return _checked(text, text)
    if isinstance(text, float):
        if text != text or text in (float("inf"), float("-inf")):
            raise InputError(f"not a size: {_quote(text)} (not a finite number; {_EXAMPLES})")
        if not text.is_integer():
            raise InputError(f"not a size: {_quote(text)} (a fraction of a byte: add a unit, e.g. '{text}GiB')")
        return _checked(text, int(text))
    match = _SIZE_RE.match(text)
    if not match:
        raise InputError(f"not a size: {_quote(text)} ({_EXAMPLES})")
    number, unit = match.groups()
    multiplier = _MULTIPLIERS.get(unit.lower())
    if multiplier is None:
        raise InputError(
            f"not a size: {_quote(text)} (unknown unit {unit!r}; "
            "use B, KiB, MiB, GiB, TiB, PiB, EiB or kB, MB, GB, TB, PB, EB)"
        )
    if len(number.lstrip("0")) > _DIGITS_MAX:
        raise InputError(f"not a size: {_quote(text)} (larger than any host: at most {format_size(MAX_SIZE)})")
    if multiplier == 1 and "." in number and float(number) != int(float(number)):
        raise InputError(f"not a size: {_quote(text)} (a fraction of a byte: add a unit, e.g. '{number}GiB')")
    value = int(number) * multiplier if "." not in number else int(round(float(number) * multiplier))
    return _checked(text, _largest_if_rounded(value, number, multiplier))


def _largest_if_rounded(value: int, number: str, multiplier: int) -> int:
    """:data:`MAX_SIZE` for a figure with a unit that is above it by less than half its
    last digit: a rounded figure of the largest size (``format_size(MAX_SIZE)`` prints
    ``8.0 EiB``, one byte more than the largest), which it stands for; else ``value``."""
    if multiplier == 1 or value <= MAX_SIZE:
        return value
    decimals = len(number.partition(".")[2])
    return MAX_SIZE if (value - MAX_SIZE) * 2 * 10**decimals <= multiplier else value


def _quote(text) -> str:
    """``repr(text)``, cut short: a 400-digit typo need not be echoed whole."""
    shown = repr(text)
    return shown if len(shown) <= 40 else f"{shown[:30]}...({len(shown)} characters)"


def _checked(text, value: int) -> int:
    """``value`` when it is a size a host can have; a ValueError quoting ``text`` if not."""
    if value < 0:
        raise InputError(f"not a size: {_quote(text)} (sizes are never negative)")
    if value > MAX_SIZE:
        raise InputError(f"not a size: {_quote(text)} (larger than any host: at most {format_size(MAX_SIZE)})")
    return value


def size_option(text: str) -> int:
    """``parse_size`` for argparse's ``type=``: a bad value is reported with its option's
    name (``argument --scale: not a size: 'abc' ...``) and exit code 2."""
    import argparse

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def format_size(num_bytes: int | float, precision: int = 1) -> str:
    """Return ``num_bytes`` as a binary-unit string such as ``"18.4 GiB"`` (:func:`parse_size` reads it back)."""
    value = float(num_bytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024:
            return f"{sign}{int(value)} B" if unit == "B" else f"{sign}{value:.{precision}f} {unit}"
        value /= 1024
    return f"{sign}{value:.{precision}f} EiB"


def parse_rate(text: str | int | float) -> float:
    """Return bytes per second for a rate such as ``"24GB/s"`` or ``"8 GiB/s"``."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if not 0 < text <= MAX_SIZE:  # NaN fails both comparisons
            raise InputError(f"not a rate: {_quote(text)} (a rate must be positive and finite)")
        return float(text)
    if not isinstance(text, str) or not text.strip().endswith("/s"):
        raise InputError(f"not a rate: {text!r} (expected e.g. '24GB/s' or '8GiB/s')")
    try:
        value = parse_size(text.strip()[:-2])
    except ValueError:
        raise InputError(f"not a rate: {text!r} (expected e.g. '24GB/s' or '8GiB/s')") from None
    if value <= 0:
        raise InputError(f"not a rate: {text!r} (a rate must be positive)")
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
            raise InputError(f"not a fraction: {text!r} (expected e.g. '75%' or 0.75)") from None
    elif isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        raise InputError(f"not a fraction: {text!r} (expected e.g. '75%' or 0.75)")
    if not 0.0 <= value <= 1.0:
        raise InputError(f"not a fraction: {text!r} (must lie between 0% and 100%)")
    return value
