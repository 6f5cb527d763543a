"""Byte sizes: parse what people type, format what people read. Sizes are ``int`` bytes everywhere."""

from __future__ import annotations

import re
from decimal import ROUND_HALF_EVEN, Decimal

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
# No device, and no 64-bit address space, holds more: a size beyond it is a misreading (a pasted message cut
# into a longer number, a typo with twenty zeros), not a figure to reason or print with.
MOST_BYTES = 2**64

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
    # Decimal, as for reported sizes: "1.1GiB" is exactly 1.1 × 1024**3, rounded down to whole bytes.
    return int(Decimal(match.group(1)) * _UNITS[unit])


def plausible_bytes(n: int | None) -> int | None:
    """``n`` where it can be a size in bytes (0 to ``MOST_BYTES``), else None: not known."""
    return n if n is not None and 0 <= n <= MOST_BYTES else None


def format_bytes(n: int | None) -> str:
    """Format bytes the way PyTorch does: 1024-based, two decimals, ``bytes``/KiB/MiB/GiB, then TiB, PiB
    and EiB; a size beyond ``MOST_BYTES`` (16 EiB) reads as more than that, never as a long number."""
    if n is None:
        return "?"
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n > MOST_BYTES:
        return "less than -16.00 EiB" if sign else "more than 16.00 EiB"
    if n < 1024:
        return f"{sign}{n} bytes"
    for unit, scale in (
        ("KiB", 1024),
        ("MiB", 1024**2),
        ("GiB", 1024**3),
        ("TiB", 1024**4),
        ("PiB", 1024**5),
    ):
        if n < scale * 1024:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{n / 1024**6:.2f} EiB"


# Units as error messages print them. Every producer we read sizes from counts in powers of 1024, whatever it
# calls the unit: PyTorch's format_size ("GiB"), MPS ("GB", "MB"), TensorFlow ("GiB" without a space), XLA
# ("G", "M"). So here, unlike parse_size, "GB" is 1024**3.
REPORTED_UNITS = {
    "bytes": 1,
    "byte": 1,
    "B": 1,
    "KiB": 1024,
    "KB": 1024,
    "K": 1024,
    "MiB": 1024**2,
    "MB": 1024**2,
    "M": 1024**2,
    "GiB": 1024**3,
    "GB": 1024**3,
    "G": 1024**3,
    "TiB": 1024**4,
    "TB": 1024**4,
    "T": 1024**4,
    "PiB": 1024**5,
    "PB": 1024**5,
    "P": 1024**5,
}
_REPORTED = re.compile(r"\s*(\d{1,30}(?:\.\d{1,30})?)\s*([A-Za-z]{1,5})\s*")


def parse_reported_size(text: str) -> int:
    """Return the bytes in a size as an error message prints it: ``8.00 GiB``, ``0 bytes``, ``129.50M``.

    All units are powers of 1024 (see ``REPORTED_UNITS``). The value is rounded half to even from its exact
    decimal value, so ``1.95 GiB`` is ``round(1.95 * 1024**3)`` = 2093796557. Raises ``ValueError`` on
    anything else.
    """
    match = _REPORTED.fullmatch(text)
    if not match or match.group(2) not in REPORTED_UNITS:
        raise ValueError(f"expected a size like 8.00 GiB, 0 bytes or 12.5 MB, got {text!r}")
    return reported_bytes(match.group(1), match.group(2))


def reported_bytes(number: str, unit: str) -> int:
    """Bytes in ``number`` (decimal digits, optional fraction) of ``unit`` (a key of ``REPORTED_UNITS``)."""
    # Decimal, not float: exact for any digit string, and no overflow to inf on absurd inputs.
    exact = Decimal(number) * REPORTED_UNITS[unit]
    return int(exact.to_integral_value(rounding=ROUND_HALF_EVEN))
