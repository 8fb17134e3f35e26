"""Sizes with units: ``512MiB``, ``4GiB``, ``1.5GB``, ``25%`` (of a reference size)."""
from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")
_PCT_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*%\s*$")


def parse_size(value: int | float | str, *, of: int | None = None) -> int:
    """Bytes from ``value``. A percentage needs ``of`` (the size it is a fraction of).

    Raises ValueError with a message that says what a valid size looks like.
    """
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"size {value} is negative")
        return int(value)
    text = str(value)
    pct = _PCT_RE.match(text)
    if pct:
        fraction = float(pct.group(1))
        if fraction > 100:
            raise ValueError(f"{text!r} is more than 100%")
        if of is None:
            raise ValueError(f"{text!r}: a percentage is not allowed here")
        return int(of * fraction / 100)
    m = _SIZE_RE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        if text.strip().startswith("-"):
            raise ValueError(f"size {text!r} is negative")
        raise ValueError(f"{text!r} is not a size (examples: 512MiB, 4GiB, 1.5GB, 25%)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: int | float) -> str:
    """Human-readable binary size: ``64 MiB``, ``1.5 GiB``, ``512 B``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(n)} B"
            return f"{n:.1f} {unit}".replace(".0 ", " ")
        n /= 1024
    raise AssertionError("unreachable")
