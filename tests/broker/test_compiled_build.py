"""The request core as installed: interpreted (an editable install) or compiled by mypyc.

``make test`` runs the core suite twice: in ``.venv`` (editable, interpreted) with
``KVCACHED_BROKER_EXPECT_COMPILED=0`` and in ``.venv-compiled`` (built with
``KVCACHED_BROKER_COMPILE=1``) with ``=1``.  These tests check that each run tests what it
says it does: a compiled build that quietly fell back to Python, or an interpreted one that
picked up stale extensions, fails here.  Without the variable they are skipped.
"""

from __future__ import annotations

import ast
import importlib
import os
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest

from kvcached_broker.broker import request_core_build
from kvcached_broker.tools.launch import BrokerLauncher

EXPECTED = os.environ.get("KVCACHED_BROKER_EXPECT_COMPILED")
pytestmark = pytest.mark.skipif(EXPECTED is None, reason="KVCACHED_BROKER_EXPECT_COMPILED is not set")
SETUP_PY = Path(__file__).resolve().parents[2] / "setup.py"


def _compiled_modules() -> list[str]:
    """``COMPILED_MODULES`` from setup.py (read, not imported: importing it would run setup)."""
    for node in ast.parse(SETUP_PY.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "COMPILED_MODULES" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no COMPILED_MODULES")


def _is_extension(module_name: str) -> bool:
    return importlib.import_module(module_name).__file__.endswith(tuple(EXTENSION_SUFFIXES))


def test_the_variable_says_compiled_or_not():
    assert EXPECTED in ("0", "1"), f"KVCACHED_BROKER_EXPECT_COMPILED must be 0 or 1, not {EXPECTED!r}"


def test_every_listed_module_is_built_as_expected():
    names = ["kvcached_broker." + path.removesuffix(".py").replace("/", ".") for path in _compiled_modules()]
    assert "kvcached_broker.broker.request_core" in names and "kvcached_broker.broker.ledger" in names
    built = {name: _is_extension(name) for name in names}
    assert built == {name: EXPECTED == "1" for name in names}
    assert request_core_build() == ("compiled" if EXPECTED == "1" else "interpreted")


def test_the_wire_schemas_stay_interpreted():
    # msgspec builds its Struct types from class bodies that mypyc would compile away.
    assert not _is_extension("kvcached_broker.client.protocol")
    assert not _is_extension("kvcached_broker.broker.state_records")


def test_the_broker_says_which_core_it_runs(short_tmp):
    with BrokerLauncher(f"ipc://{short_tmp}/gpu0.sock", simulate="8GiB", capture=True) as broker:
        ready = next(line for line in broker.stderr().splitlines() if "event=ready" in line)
    assert f"request_core={'compiled' if EXPECTED == '1' else 'interpreted'}" in ready
