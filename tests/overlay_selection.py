"""Which overlay a test module needs: its ``runtime`` marker, read without importing it.

A test of the adapters against a runtime's real classes needs that runtime installed, which only
an overlay run has (scripts/test-adapters.sh: ``sglang-0.5.23``, ``kvcached-0.1.6``, the combined
``kvcached+sglang-0.5.23``).  Such a module says so once, at its top::

    pytestmark = pytest.mark.runtime("kvcached", "sglang")

and the run selects by that alone, wherever the module lives: a run collects exactly the modules
whose runtimes are the overlay's (none for the core run, outside any overlay), and enters only the
folders that hold one.  The marker is read from the module's source (:func:`needs`), so neither a
module whose runtime is absent nor its folder's conftest is ever imported.

The overlay being run comes from the environment scripts/test-adapters.sh sets:
``KVCACHED_BROKER_TEST_RUNTIME`` (``sglang-0.5.23``, or ``kvcached-0.1.6`` alone) and, for a
combined overlay, ``KVCACHED_BROKER_TEST_KVCACHED`` (``kvcached-0.1.6``).
"""

from __future__ import annotations

import ast
import functools
import os
from pathlib import Path

#: The runtimes a marker may name.
RUNTIMES = frozenset({"sglang", "vllm", "kvcached"})


class MarkerError(ValueError):
    """A ``runtime`` marker the selection cannot read (one line)."""


def needs(path: Path) -> frozenset[str]:
    """The runtimes the module at ``path`` declares in its module-level ``pytestmark`` (empty:
    none, a core test).  Raises :class:`MarkerError` for a marker that is not a call with
    literal runtime names."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                     for t in node.targets)):
            continue
        marks = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
        for mark in marks:
            if _is_runtime_mark(mark.func if isinstance(mark, ast.Call) else mark):
                found |= _names(path, mark)
    return frozenset(found)


def _is_runtime_mark(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "runtime"


def _names(path: Path, mark: ast.expr) -> set[str]:
    if not isinstance(mark, ast.Call) or not mark.args or mark.keywords:
        raise MarkerError(f"{path}: pytest.mark.runtime needs the runtimes' names, as literal strings")
    names = set()
    for arg in mark.args:
        if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value in RUNTIMES):
            raise MarkerError(f"{path}: pytest.mark.runtime takes {sorted(RUNTIMES)}, got {ast.unparse(arg)}")
        names.add(arg.value)
    return names


def current(environ: dict[str, str] | None = None) -> frozenset[str]:
    """The runtimes of the overlay being run (empty outside one)."""
    env = os.environ if environ is None else environ
    runtime = env.get("KVCACHED_BROKER_TEST_RUNTIME", "").strip()
    names = {runtime.split("-", 1)[0]} if runtime else set()
    if env.get("KVCACHED_BROKER_TEST_KVCACHED", "").strip():
        names.add("kvcached")
    return frozenset(names)


#: :func:`needs` read once per module in a run: each folder's check reads every module below it,
#: and each module is checked again as a file (the sources do not change during a run).
needs_in_run = functools.cache(needs)


def selected_anywhere(folder: Path, overlay: frozenset[str]) -> bool:
    """Whether any test module under ``folder`` runs in ``overlay``.  A run enters no other
    folder, so it imports no other folder's conftest (one imports kvcached, which fixes its
    default segment name at its first import: every later pool of that process would share it)."""
    return any(selected(needs_in_run(path), overlay) for path in folder.rglob("test_*.py"))


def selected(module_needs: frozenset[str], overlay: frozenset[str]) -> bool:
    """A module runs where its runtimes are exactly the overlay's: core tests outside any overlay,
    ``runtime("sglang")`` in an SGLang overlay, ``runtime("kvcached", "sglang")`` in the combined."""
    return module_needs == overlay
