"""Byte sizes as operators write them, and back.

Every size in kvcached-broker is an ``int`` of bytes.  Operators write binary sizes
(``80GiB``, ``512MiB``, ``1.5GiB``) or the short forms ``2G`` / ``512M``, which mean the
same binary units.  Decimal units (``GB``, ``MB``) are refused: "80GB" is 80e9 to a disk
vendor and 80 GiB to most GPU tools, and a broker must not guess.
"""

from __future__ import annotations

import re

_BINARY_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GIB": 1 << 30,
    "T": 1 << 40,
    "TIB": 1 << 40,
}
_DECIMAL_UNITS = {"KB", "MB", "GB", "TB", "PB"}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")

#: The largest size any input may name (64 PiB): far beyond any device, small enough that
#: arithmetic on sums of sizes never leaves the range of a MessagePack int64.
MAX_SIZE_BYTES = 1 << 56


class SizeError(ValueError):
    """A size string that cannot be read.  The message is one line, fit for a CLI."""


def parse_size(text: str) -> int:
    """Return the number of bytes ``text`` names, e.g. ``parse_size("1.5GiB") == 1610612736``.

    A bare number is bytes.  Fractions are allowed with a unit and must come out to a whole
    number of bytes.
    """
    if not isinstance(text, str):
        raise SizeError(f"size must be a string, got {type(text).__name__}")
    match = _SIZE_RE.match(text)
    if not match:
        raise SizeError(f"invalid size {text!r}: expected a number and a binary unit, e.g. 80GiB, 512MiB, 2G")
    number, unit = match.group(1), match.group(2).upper()
    if unit in _DECIMAL_UNITS:
        binary = unit[0] + "iB"
        raise SizeError(f"invalid size {text!r}: decimal unit {match.group(2)} is ambiguous; use {binary} (binary)")
    if unit not in _BINARY_UNITS:
        raise SizeError(f"invalid size {text!r}: unknown unit {match.group(2)!r}; use B, KiB, MiB, GiB or TiB")
    scale = _BINARY_UNITS[unit]
    if "." in number:
        whole, frac = number.split(".")
        numerator = int(whole + frac) * scale
        denominator: int = 10 ** len(frac)
        if numerator % denominator:
            raise SizeError(f"invalid size {text!r}: does not come to a whole number of bytes")
        value = numerator // denominator
    else:
        value = int(number) * scale
    if value > MAX_SIZE_BYTES:
        raise SizeError(f"invalid size {text!r}: larger than the maximum of {format_bytes(MAX_SIZE_BYTES)}")
    return value


def parse_headroom(text: str, total_bytes: int | None = None) -> tuple[int | None, float | None]:
    """Read ``--headroom``: a size (``4GiB``) or a percentage of total (``5%``).

    Returns ``(bytes, None)`` for a size and ``(None, fraction)`` for a percentage; with
    ``total_bytes`` given, a percentage is resolved to bytes too.
    """
    stripped = text.strip() if isinstance(text, str) else text
    if isinstance(stripped, str) and stripped.endswith("%"):
        try:
            percent = float(stripped[:-1])
        except ValueError:
            raise SizeError(f"invalid headroom {text!r}: expected a size (4GiB) or a percentage (5%)") from None
        if not 0.0 <= percent < 100.0:
            raise SizeError(f"invalid headroom {text!r}: a percentage must be at least 0% and below 100%")
        fraction = percent / 100.0
        if total_bytes is not None:
            return int(total_bytes * fraction), fraction
        return None, fraction
    return parse_size(text), None


def format_bytes(num_bytes: int | None) -> str:
    """Human binary size, e.g. ``format_bytes(3 << 30) == '3.00 GiB'``; ``None`` is 'none'."""
    if num_bytes is None:
        return "none"
    sign = "-" if num_bytes < 0 else ""
    value = abs(num_bytes)
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= scale:
            return f"{sign}{value / scale:.2f} {unit}"
    return f"{sign}{value} B"


def format_bytes_apart(first_bytes: int, second_bytes: int) -> tuple[str, str]:
    """Both sizes as :func:`format_bytes` words them, unless that would make two different
    sizes read the same (an ask 13 KiB above the room, both '1.20 GiB'): then both in bytes,
    so that a message never contradicts itself."""
    first, second = format_bytes(first_bytes), format_bytes(second_bytes)
    if first == second and first_bytes != second_bytes:
        return f"{first_bytes:,} B", f"{second_bytes:,} B"
    return first, second
