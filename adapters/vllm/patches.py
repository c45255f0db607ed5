"""The vLLM patch set (filled in by the vLLM adapter modules)."""

from __future__ import annotations

from ..patching import Patch

PATCHES: list[Patch] = []


def check_flags() -> None:
    pass
