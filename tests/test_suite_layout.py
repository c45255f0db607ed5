"""The suite's own layout: what would stop pytest before any test runs."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import overlay_selection
import pytest

TESTS = Path(__file__).resolve().parent


def test_every_test_module_has_a_name_of_its_own():
    """pytest imports test modules by their base name (no package above them): two of one name
    in different folders stop the collection of the whole tree."""
    names = Counter(path.name for path in TESTS.rglob("test_*.py"))
    assert [name for name, count in names.items() if count > 1] == []


def _modules() -> list[Path]:
    """Every module of the suite that pytest or a test imports by its base name (the runtimes'
    import stubs and the fetched upstream tests have their own roots)."""
    return [path for path in TESTS.rglob("*.py")
            if path.name not in ("conftest.py", "__init__.py") and "__pycache__" not in path.parts
            and not {"stubs", "upstream"} & set(path.relative_to(TESTS).parts)]


def test_every_module_of_the_suite_has_a_name_of_its_own():
    """Test folders are put on ``sys.path`` by pytest and by the worker scripts: a helper module
    of one folder would shadow another's of the same name (``overlays`` once did)."""
    names = Counter(path.name for path in _modules())
    assert [name for name, count in names.items() if count > 1] == []


#: Test folders that mirror no package folder, and why.
NOT_A_PACKAGE = {
    "colocation": "whole servers of both runtimes started side by side",
}


def test_the_tests_mirror_the_packages():
    """A test lives in the folder of the package it tests (tests/broker for broker/, tests/adapters/
    kvcached for adapters/kvcached/); the suite's own checks and the deploy files' stay at the top."""
    root = TESTS.parent
    folders = {path.parent.relative_to(TESTS).as_posix() for path in TESTS.rglob("test_*.py")
               if "upstream" not in path.parts}
    strays = sorted(folder for folder in folders - {"."} - set(NOT_A_PACKAGE)
                    if not (root / folder / "__init__.py").is_file())
    assert strays == []
    assert sorted(set(NOT_A_PACKAGE) - folders) == []  # an exception whose folder is gone


def test_every_runtime_marker_is_one_the_selection_reads():
    """The overlay a module needs is read from its source (tests/overlay_selection.py): a runtime
    marker anywhere but the module's ``pytestmark`` would be invisible to it."""
    def runtime_marks(node: ast.AST) -> int:
        return sum(1 for n in ast.walk(node) if isinstance(n, ast.Attribute) and n.attr == "runtime"
                   and isinstance(n.value, ast.Attribute) and n.value.attr == "mark")

    for path in _modules():
        tree = ast.parse(path.read_text())
        declared = [n for n in tree.body if isinstance(n, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)]
        assert runtime_marks(tree) == sum(runtime_marks(n) for n in declared), (
            f"{path}: pytest.mark.runtime outside the module's pytestmark")
        if declared and runtime_marks(tree):
            assert overlay_selection.needs(path)


def test_the_selection_reads_the_marker_in_each_form_and_refuses_what_it_cannot_read(tmp_path):
    def module(text: str) -> Path:
        path = tmp_path / "test_x.py"
        path.write_text("import pytest\n" + text)
        return path

    assert overlay_selection.needs(module("x = 1\n")) == frozenset()
    assert overlay_selection.needs(module("pytestmark = pytest.mark.runtime('kvcached', 'sglang')\n")) == {
        "kvcached", "sglang"}
    assert overlay_selection.needs(module("pytestmark = [pytest.mark.slow, pytest.mark.runtime('vllm')]\n")) == {
        "vllm"}
    for bad in ("pytestmark = pytest.mark.runtime\n", "pytestmark = pytest.mark.runtime('torch')\n",
                "NAME = 'vllm'\npytestmark = pytest.mark.runtime(NAME)\n"):
        with pytest.raises(overlay_selection.MarkerError, match="pytest.mark.runtime"):
            overlay_selection.needs(module(bad))


def test_a_run_selects_the_modules_of_exactly_its_overlays_runtimes():
    current = overlay_selection.current
    assert current({}) == frozenset()
    assert current({"KVCACHED_BROKER_TEST_RUNTIME": "sglang-0.5.23"}) == {"sglang"}
    assert current({"KVCACHED_BROKER_TEST_RUNTIME": "kvcached-0.1.6"}) == {"kvcached"}
    assert current({"KVCACHED_BROKER_TEST_RUNTIME": "vllm-0.34.0",
                    "KVCACHED_BROKER_TEST_KVCACHED": "kvcached-0.1.6"}) == {"kvcached", "vllm"}
    selected = overlay_selection.selected
    assert selected(frozenset(), frozenset()) and not selected(frozenset({"sglang"}), frozenset())
    assert selected(frozenset({"kvcached", "sglang"}), frozenset({"kvcached", "sglang"}))
    assert not selected(frozenset({"kvcached"}), frozenset({"kvcached", "sglang"}))
    assert not selected(frozenset(), frozenset({"sglang"}))


def test_a_run_enters_only_the_folders_that_hold_one_of_its_modules(tmp_path):
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "test_a.py").write_text("def test_a(): pass\n")
    (tmp_path / "runtime" / "deeper").mkdir(parents=True)
    (tmp_path / "runtime" / "deeper" / "test_b.py").write_text(
        "import pytest\npytestmark = pytest.mark.runtime('kvcached', 'vllm')\n")
    anywhere = overlay_selection.selected_anywhere
    assert anywhere(tmp_path / "core", frozenset()) and not anywhere(tmp_path / "runtime", frozenset())
    assert anywhere(tmp_path / "runtime", frozenset({"kvcached", "vllm"}))
    assert not anywhere(tmp_path / "core", frozenset({"kvcached"}))
