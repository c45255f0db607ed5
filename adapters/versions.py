"""Version gates for patches, without depending on ``packaging`` (it may not be installed)."""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version

_PART = re.compile(r"^(\d+(?:\.\d+)*)(?:\.?(post|rc|dev|a|b)(\d+))?")


def parse(text: str) -> tuple[int, ...]:
    """``"0.5.13.post1"`` -> ``(0, 5, 13, 0, 1)``; pre-releases sort before their release.

    The last two fields are the kind (-1 pre-release, 0 release, and then the post number).
    """
    match = _PART.match(text.strip().lstrip("v"))
    if not match:
        raise ValueError(f"cannot read version {text!r}")
    numbers = tuple(int(p) for p in match.group(1).split("."))
    numbers = numbers + (0,) * max(0, 3 - len(numbers))
    kind, number = match.group(2), int(match.group(3) or 0)
    if kind in ("rc", "dev", "a", "b"):
        return numbers + (-1, number)
    if kind == "post":
        return numbers + (0, number)
    return numbers + (0, 0)


def installed(distribution: str) -> str | None:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def in_range(current: str, minimum: str | None = None, below: str | None = None) -> bool:
    """``minimum <= current < below`` (either bound may be None)."""
    value = parse(current)
    if minimum is not None and value < parse(minimum):
        return False
    if below is not None and value >= parse(below):
        return False
    return True
