"""Byte sizes: parse what people type, format what people read. Sizes are ``int`` bytes everywhere."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "byte": 1,
    "bytes": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """Return the bytes in a size like ``24GiB``, ``8GB``, ``512MiB``, ``1.5G`` or ``4096``.

    SI units (``GB``) are powers of 1000, IEC units (``GiB``) and bare letters (``G``) powers of 1024.
    Raises ``ValueError`` naming the bad value and the accepted forms.
    """
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(f"expected a size like 24GiB, 8GB, 512MiB or 4096 (bytes), got {text!r}")
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: int | None) -> str:
    """Format bytes the way PyTorch does: 1024-based, two decimals, ``bytes``/KiB/MiB/GiB/TiB."""
    if n is None:
        return "?"
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n < 1024:
        return f"{sign}{n} bytes"
    for unit, scale in (("KiB", 1024), ("MiB", 1024**2), ("GiB", 1024**3)):
        if n < scale * 1024:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{n / 1024**4:.2f} TiB"
