"""Adapter tests run inside one upstream overlay at a time (scripts/test-adapters.sh).

``KVCACHED_BROKER_TEST_RUNTIME`` names the overlay (``sglang-0.5.23``).  When it is set, the
runtime must be importable at that exact version: a missing runtime is a failure, not a
skip.  Without it (a plain ``pytest`` run) these tests are skipped.
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version

import pytest

EXPECTED = os.environ.get("KVCACHED_BROKER_TEST_RUNTIME", "")


def runtime_version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def require_runtime(dist: str) -> str:
    """The installed version of ``dist``; skip (or fail, inside an overlay run) without it."""
    found = runtime_version(dist)
    if EXPECTED.startswith(dist + "-"):
        want = EXPECTED[len(dist) + 1 :]
        assert found == want, f"overlay {EXPECTED} expected {dist} {want}, found {found}"
    elif found is None or not EXPECTED:
        pytest.skip(f"{dist} adapter tests run inside an overlay (make test-adapters)")
    return found
