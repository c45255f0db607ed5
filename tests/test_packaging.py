"""What installing the project does: the same versions on every fresh machine, and a build
that says nothing of the project's own making.

* ``constraints/test.txt`` and ``constraints/build.txt`` (written by ``make constraints``,
  scripts/pythons.py) pin, per supported Python, everything ``pip install '.[test]'`` and a
  build install; the Makefile installs with them.  The tests here fail when an install did
  not follow them, or when pyproject.toml changed without them being resolved again.
* A newcomer's first ``make demo`` or ``make test`` starts with ``pip install -e '.[test]'``;
  whatever setuptools warns about there (a deprecated ``pyproject.toml`` field, the notice that
  ends every editable install through a finder) is the first thing they read.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
TEST_CONSTRAINTS = ROOT / "constraints" / "test.txt"
BUILD_CONSTRAINTS = ROOT / "constraints" / "build.txt"
LINT_CONSTRAINTS = ROOT / "constraints" / "lint.txt"
RUNNING = "%d.%d" % sys.version_info[:2]


def supported_pythons() -> list[str]:
    """pyproject.toml's ``Programming Language :: Python :: 3.X`` classifiers."""
    return [m.group(1) for c in PYPROJECT["project"]["classifiers"]
            if (m := re.fullmatch(r"Programming Language :: Python :: (3\.\d+)", c))]


def environment(python: str, extra: str = "") -> dict[str, str]:
    """Marker variables of this machine, as on ``python`` (``X.Y``)."""
    return {"python_version": python, "python_full_version": f"{python}.0", "extra": extra}


def pins(path: Path, python: str) -> dict[str, str]:
    """``{canonical name: version}`` that ``path`` pins on ``python``; a name pinned twice fails."""
    found: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(environment(python)):
            continue
        (spec,) = req.specifier
        assert spec.operator == "==", f"{path.name}: not an exact pin: {line}"
        name = canonicalize_name(req.name)
        assert name not in found, f"{path.name} pins {name} twice for Python {python}"
        found[name] = spec.version
    return found


def build_requirements() -> list[str]:
    """``[build-system] requires`` and setup.py's ``BUILD_REQUIREMENTS`` (setup.py read, not run)."""
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "BUILD_REQUIREMENTS" for t in node.targets):
            return [*PYPROJECT["build-system"]["requires"], *ast.literal_eval(node.value)]
    raise AssertionError("setup.py has no BUILD_REQUIREMENTS")


def installed_closure() -> dict[str, str]:
    """``{canonical name: installed version}`` of everything ``kvcached-broker[test]`` needs
    here, the project itself left out."""
    found: dict[str, str] = {}
    todo = [("kvcached-broker", frozenset({"test"}))]
    seen = set()
    while todo:
        name, extras = todo.pop()
        if (canonicalize_name(name), extras) in seen:
            continue
        seen.add((canonicalize_name(name), extras))
        dist = importlib.metadata.distribution(name)
        if canonicalize_name(name) != "kvcached-broker":
            found[canonicalize_name(name)] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate(environment(RUNNING, e)) for e in extras | {""}):
                todo.append((req.name, frozenset(req.extras)))
    return found


def test_the_constraints_cover_exactly_the_supported_pythons():
    """pyproject.toml's classifiers say which Pythons are supported; requires-python, the
    README and the constraints' header say the same."""
    versions = supported_pythons()
    assert versions and versions == sorted(versions, key=lambda v: int(v.split(".")[1]))
    assert PYPROJECT["project"]["requires-python"] == f">={versions[0]}"
    assert f"Python ≥ {versions[0]}" in (ROOT / "README.md").read_text()
    for path in (TEST_CONSTRAINTS, BUILD_CONSTRAINTS):
        assert f"# Pythons: {' '.join(versions)}\n" in path.read_text(), f"{path.name}: run make constraints"


@pytest.mark.parametrize("python", ["3.10", "3.11", "3.12", "3.13"])
def test_every_requirement_is_pinned_within_its_range_on_every_supported_python(python):
    """A requirement added to pyproject.toml or setup.py, or a range changed, without
    ``make constraints`` fails here: each supported Python gets one pin per package, inside
    the range the project asks for."""
    if python not in supported_pythons():
        pytest.skip(f"Python {python} is not supported")
    project = PYPROJECT["project"]
    checks = [(TEST_CONSTRAINTS, [*project["dependencies"], *project["optional-dependencies"]["test"]]),
              (BUILD_CONSTRAINTS, build_requirements())]
    for path, requirements in checks:
        pinned = pins(path, python)
        for line in requirements:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(environment(python, "test")):
                continue
            version = pinned.get(canonicalize_name(req.name))
            assert version is not None, f"{path.name} pins no {req.name} for Python {python}: run make constraints"
            assert req.specifier.contains(version, prereleases=True), f"{path.name}: {req.name}=={version} is outside {line!r}"


def test_the_lint_tools_are_pinned_within_their_ranges():
    """``make lint`` installs the ``lint`` extra with constraints/lint.txt and build.txt (mypy at
    the version that compiles the request core): each tool has exactly one pin, inside its range,
    and lint.txt pins nothing the other two files already do."""
    lint, build, test = (pins(path, RUNNING) for path in (LINT_CONSTRAINTS, BUILD_CONSTRAINTS, TEST_CONSTRAINTS))
    assert not set(lint) & (set(build) | set(test)), "constraints/lint.txt pins what build.txt or test.txt does"
    for line in PYPROJECT["project"]["optional-dependencies"]["lint"]:
        req = Requirement(line)
        version = {**build, **lint}.get(canonicalize_name(req.name))
        assert version is not None, f"neither lint.txt nor build.txt pins {req.name}"
        assert req.specifier.contains(version), f"{req.name}=={version} is outside {line!r}"


def test_this_environment_installed_what_the_constraints_pin():
    """Every distribution that ``kvcached-broker[test]`` pulls in here is at its pinned version:
    the install followed constraints/test.txt, and the file holds the whole closure."""
    pinned = pins(TEST_CONSTRAINTS, RUNNING)
    installed = installed_closure()
    assert {"pytest", "hypothesis", "msgspec", "pyzmq"} <= set(installed)
    assert {name: version for name, version in installed.items() if pinned.get(name) != version} == {}, (
        "installed outside constraints/test.txt (reinstall with make, or run make constraints)")
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


def test_every_package_folder_is_in_the_wheel():
    """pyproject lists the packages by name (the source folders map to ``kvcached_broker.*``):
    a new subpackage missing there would import in an editable install and be absent from
    the wheel, so every folder with an ``__init__.py`` must be listed, and nothing else."""
    setuptools = PYPROJECT["tool"]["setuptools"]
    folders = {}
    for name, folder in setuptools["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            folders[".".join((name, *relative.parts))] = init.parent
    assert sorted(setuptools["packages"]) == sorted(folders)
