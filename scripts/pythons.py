#!/usr/bin/env python3
"""The Pythons the project supports: which, where to find them, and what they resolve to.

    pythons.py versions              # the supported X.Y, from pyproject.toml's classifiers
    pythons.py find X.Y              # the path of an interpreter for X.Y (exit 1 if there is none)
    pythons.py constraints [X.Y ...] # rewrite constraints/test.txt and constraints/build.txt

The supported Pythons are pyproject.toml's ``Programming Language :: Python :: X.Y``
classifiers.  ``find`` looks in pyenv's versions (``$PYENV_ROOT`` or ``pyenv root``; the
newest patch release) and then for a ``pythonX.Y`` on ``PATH`` that runs (pyenv's shims do
not, for a version that is not selected).

``constraints`` (``make constraints``) resolves, in a fresh venv of each supported Python
(the newest pip; the package index of pip's own configuration):

* ``constraints/test.txt``: pip, and what ``pip install '.[test]'`` installs (the runtime
  dependencies, the ``test`` extra and all that they need).  On the Python that runs this
  script (``.venv``'s, where ``make adapter-envs`` installs torch), the adapter base's pins
  from scripts/adapter-envs.sh (torch, triton) and their dependencies as well;
* ``constraints/build.txt``: what building the package installs in pip's isolated build
  environment: ``[build-system] requires`` and, for ``KVCACHED_BROKER_COMPILE=1``, setup.py's
  ``BUILD_REQUIREMENTS`` (mypy, with the libraries whose types it checks).

A package every Python resolves to the same version gets one ``name==version`` line; the
others get one line per Python, with a ``python_version`` marker.  The Makefile installs with
``-c constraints/test.txt --build-constraint constraints/build.txt``, so every fresh machine
installs exactly these versions.  With versions given, only those are resolved again, and
the other Pythons' lines are kept as they are.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the project depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
TEST_CONSTRAINTS = ROOT / "constraints" / "test.txt"
BUILD_CONSTRAINTS = ROOT / "constraints" / "build.txt"
CLASSIFIER = re.compile(r"^Programming Language :: Python :: (3\.\d+)$")
MARKER = re.compile(r"""^\s*python_version\s*==\s*["'](3\.\d+)["']\s*$""")


class Failure(Exception):
    """A one-line reason this script cannot go on."""


def normalized(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def supported_versions() -> list[str]:
    """The ``X.Y`` of every ``Programming Language :: Python :: X.Y`` classifier, oldest first."""
    found = [m.group(1) for c in pyproject()["project"].get("classifiers", []) if (m := CLASSIFIER.match(c))]
    if not found:
        raise Failure("pyproject.toml has no 'Programming Language :: Python :: 3.X' classifier")
    return sorted(found, key=lambda v: tuple(map(int, v.split("."))))


def _runs_as(path: str, version: str) -> bool:
    try:
        out = subprocess.run([path, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=60)
    except OSError:
        return False
    return out.returncode == 0 and out.stdout.strip() == version


def _pyenv_root() -> Path | None:
    if os.environ.get("PYENV_ROOT"):
        return Path(os.environ["PYENV_ROOT"])
    if shutil.which("pyenv"):
        out = subprocess.run(["pyenv", "root"], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip():
            return Path(out.stdout.strip())
    return None


def find_python(version: str) -> str:
    """An interpreter for ``version`` (``X.Y``): pyenv's newest patch release of it, else a
    ``pythonX.Y`` on ``PATH`` that runs and is that version."""
    if not re.fullmatch(r"3\.\d+", version):
        raise Failure(f"a Python version is 3.X, not {version!r}")
    root = _pyenv_root()
    if root is not None:
        patch = re.compile(rf"^{re.escape(version)}\.(\d+)$")
        releases = sorted(((int(m.group(1)), d) for d in (root / "versions").glob(f"{version}.*")
                           if (m := patch.match(d.name))), reverse=True)
        for _, d in releases:
            candidate = d / "bin" / f"python{version}"
            if _runs_as(str(candidate), version):
                return str(candidate)
    on_path = shutil.which(f"python{version}")
    if on_path and _runs_as(on_path, version):
        return on_path
    raise Failure(f"no Python {version} found (pyenv's versions/{version}.*, or python{version} on PATH): "
                  f"install it (e.g. 'pyenv install {version}')")


def _build_requirements() -> list[str]:
    """``[build-system] requires`` and setup.py's ``BUILD_REQUIREMENTS`` (read, not imported:
    importing setup.py runs setup())."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "BUILD_REQUIREMENTS" for t in node.targets):
            return [*pyproject()["build-system"]["requires"], *ast.literal_eval(node.value)]
    raise Failure("setup.py has no BUILD_REQUIREMENTS list")


def _test_requirements() -> list[str]:
    project = pyproject()["project"]
    return ["pip", *project["dependencies"], *project["optional-dependencies"]["test"]]


def _adapter_base_pins() -> list[str]:
    """``TORCH_PIN`` and ``TRITON_PIN`` of scripts/adapter-envs.sh: what it installs into .venv."""
    text = (ROOT / "scripts" / "adapter-envs.sh").read_text()
    pins = re.findall(r'^(?:TORCH|TRITON)_PIN="([^"]+)"', text, re.M)
    if len(pins) != 2:
        raise Failure("scripts/adapter-envs.sh: expected TORCH_PIN and TRITON_PIN lines")
    return pins


def _pip(python: str, *args: str) -> None:
    # PIP_CONSTRAINT= drops a constraints file from pip's configuration: what is resolved
    # here becomes the constraints, so nothing else may narrow it.
    env = {**os.environ, "PIP_CONSTRAINT": ""}
    out = subprocess.run([python, "-m", "pip", "--disable-pip-version-check", "--no-input", *args],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        lines = [line for line in out.stderr.splitlines() if line.strip() and not line.startswith("WARNING: Location")]
        raise Failure(f"pip {args[0]} failed with {python}: {lines[-1] if lines else 'exit %d' % out.returncode}")


def resolve(python: str, requirements: list[str], scratch: Path) -> dict[str, str]:
    """What ``pip install --only-binary=:all: REQUIREMENTS`` installs with ``python`` into an
    empty venv: ``{normalized name: version}``.  Nothing is installed but the venv's pip."""
    venv = scratch / "venv"
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    vpy = str(venv / "bin" / "python")
    _pip(vpy, "install", "--quiet", "--upgrade", "pip")
    report = scratch / "report.json"
    # Wheels only: a pin must install on a fresh machine without a compiler (atheris 3.0.0 is
    # an sdist for Python 3.10, which needs clang's libFuzzer to build).
    _pip(vpy, "install", "--quiet", "--dry-run", "--ignore-installed", "--only-binary=:all:",
         "--report", str(report), *requirements)
    installs = json.loads(report.read_text())["install"]
    return {normalized(item["metadata"]["name"]): item["metadata"]["version"] for item in installs}


def read_constraints(path: Path) -> dict[str, dict[str, str]]:
    """``{python version: {normalized name: version}}`` from a file this script wrote, for the
    versions its header names."""
    header = re.search(r"^# Pythons: (.+)$", path.read_text(), re.M) if path.exists() else None
    if header is None:
        return {}
    versions = header.group(1).split()
    pins: dict[str, dict[str, str]] = {v: {} for v in versions}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement, _, marker = line.partition(";")
        name, _, version = requirement.strip().partition("==")
        if marker.strip():
            m = MARKER.match(marker)
            if m is None:
                raise Failure(f"{path.name}: a marker this script did not write: {line!r}")
            targets = [m.group(1)]
        else:
            targets = versions
        for v in targets:
            if v in pins:
                pins[v][normalized(name)] = version.strip()
    return pins


def render(title: str, pins: dict[str, dict[str, str]]) -> str:
    """The constraints file: one unmarked line for a package every Python pins alike, else a
    line per Python with a ``python_version`` marker."""
    versions = sorted(pins, key=lambda v: tuple(map(int, v.split("."))))
    lines = [
        f"# {title}",
        "# Written by scripts/pythons.py (make constraints): do not edit by hand.",
        f"# Pythons: {' '.join(versions)}",
    ]
    names = sorted({name for per in pins.values() for name in per})
    for name in names:
        found = {v: pins[v].get(name) for v in versions}
        if all(found.values()) and len(set(found.values())) == 1:
            lines.append(f"{name}=={found[versions[0]]}")
        else:
            lines.extend(f'{name}=={ver} ; python_version == "{v}"' for v, ver in found.items() if ver)
    return "\n".join(lines) + "\n"


def refresh(only: list[str]) -> None:
    versions = supported_versions()
    unknown = [v for v in only if v not in versions]
    if unknown:
        raise Failure(f"not a supported Python: {' '.join(unknown)} (supported: {' '.join(versions)})")
    running = "%d.%d" % sys.version_info[:2]
    test = {v: p for v, p in read_constraints(TEST_CONSTRAINTS).items() if v in versions}
    build = {v: p for v, p in read_constraints(BUILD_CONSTRAINTS).items() if v in versions}
    with tempfile.TemporaryDirectory(prefix="kvb-constraints-") as tmp:
        for version in only or versions:
            python = find_python(version)
            print(f"resolving for Python {version} ({python})", file=sys.stderr)
            requirements = _test_requirements() + (_adapter_base_pins() if version == running else [])
            test[version] = resolve(python, requirements, Path(tmp))
            build[version] = resolve(python, _build_requirements(), Path(tmp))
    missing = [v for v in versions if v not in test]
    if missing:
        raise Failure(f"no earlier resolution for Python {' '.join(missing)}: run without versions to resolve them all")
    TEST_CONSTRAINTS.parent.mkdir(exist_ok=True)
    TEST_CONSTRAINTS.write_text(render("What pip install '.[test]' installs (and pip itself), per supported Python.", test))
    BUILD_CONSTRAINTS.write_text(render("What building the package installs (setuptools; mypy for KVCACHED_BROKER_COMPILE=1).", build))
    print(f"wrote {TEST_CONSTRAINTS.relative_to(ROOT)} and {BUILD_CONSTRAINTS.relative_to(ROOT)}", file=sys.stderr)


def main(argv: list[str]) -> int:
    try:
        if argv[:1] == ["versions"] and len(argv) == 1:
            print(" ".join(supported_versions()))
        elif argv[:1] == ["find"] and len(argv) == 2:
            print(find_python(argv[1]))
        elif argv[:1] == ["constraints"]:
            refresh(argv[1:])
        else:
            print(__doc__.split("\n\n")[1], file=sys.stderr)
            return 2
    except Failure as e:
        print(f"pythons.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
