"""The suite's own layout: what would stop pytest before any test runs."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_every_test_module_has_a_name_of_its_own():
    """pytest imports test modules by their base name (no package above them): two of one name
    in different folders stop the collection of the whole tree."""
    names = Counter(path.name for path in TESTS.rglob("test_*.py"))
    assert [name for name, count in names.items() if count > 1] == []
