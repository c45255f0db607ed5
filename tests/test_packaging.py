"""What installing the project does: a build that says nothing of the project's own making.

A newcomer's first ``make demo`` or ``make test`` starts with ``pip install -e '.[test]'``;
whatever setuptools warns about there (a deprecated ``pyproject.toml`` field, the notice that
ends every editable install through a finder) is the first thing they read.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: What a build reads: the metadata, the package folders (pyproject.toml's package-dir) and the README.
BUILD_INPUTS = ["pyproject.toml", "setup.py", "README.md", "broker", "client", "adapters", "tools"]
#: Runs one PEP 517 hook of setuptools (as pip does, in a process of its own) and writes every
#: Python warning it raised, whatever the filters outside, to the file named last.
HOOK = """
import json, sys, warnings
from setuptools import build_meta
hook, out_dir, report = sys.argv[1:]  # read first: setuptools rewrites sys.argv for setup.py
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    getattr(build_meta, hook)(out_dir)
with open(report, "w") as f:
    json.dump([f"{w.category.__name__}: {str(w.message).strip().splitlines()[0]}" for w in caught], f)
"""


@pytest.fixture(scope="module")
def source_tree(tmp_path_factory) -> Path:
    """A copy of what a build reads, so that building here writes nothing into the repository."""
    tree = tmp_path_factory.mktemp("source")
    for name in BUILD_INPUTS:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, tree / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            shutil.copy2(src, tree / name)
    return tree


@pytest.mark.parametrize("hook", ["build_wheel", "build_editable"])
def test_building_the_package_raises_no_warning(source_tree, tmp_path, hook):
    """``pip wheel .`` and ``pip install -e .`` run these hooks; pip shows their warnings
    even with ``--quiet``.  Neither the metadata nor setup.py may give setuptools a reason."""
    pytest.importorskip("setuptools")
    report = tmp_path / "warnings.json"
    out = subprocess.run([sys.executable, "-c", HOOK, hook, str(tmp_path / "dist"), str(report)],
                         cwd=source_tree, capture_output=True, text=True, env=_without_compile())
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(report.read_text()) == []
    assert len(list((tmp_path / "dist").glob("kvcached_broker-*.whl"))) == 1


def test_nothing_at_the_repository_root_shadows_the_editable_install():
    """An editable install maps ``kvcached_broker`` to the source folders through a finder that
    Python consults after ``sys.path``: a folder or module of that name where a command runs
    (the repository root, for ``make`` and pytest) would be imported instead.  setup.py
    silences setuptools' general notice about it because of this test."""
    assert not [p.name for p in ROOT.iterdir() if p.name.split(".")[0] == "kvcached_broker" and not p.name.endswith(".egg-info")]


def _without_compile() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "KVCACHED_BROKER_COMPILE"}
