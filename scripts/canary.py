#!/usr/bin/env python3
"""The canary: does the newest release of each runtime still have every symbol the patches change?

    canary.py [--report] [--dir DIR] [--archives DIR]

For SGLang, vLLM and kvcached, the newest release on the package index in pip's configuration
is fetched without installing it (``pip download --no-deps``: a wheel where there is one, else
the sdist; kvcached ships only an sdist whose build needs CUDA, so its newest sdist is
downloaded from the simple index directly, as scripts/fetch-kvcached.py does) into DIR
(``.canary/``, reused by a later run).  Nothing in it is imported or run: each patch target of
that release's module layout (``Target``s of ``adapters/*/patches.py``, the layouts of
``adapters/support.py``) is looked up in the release's own source with ``ast``: the module, the
class, the method the class defines itself (a patch never changes an inherited one), and the
leading parameters the wrapper relies on.  One table says, per runtime, the release, whether the
table of supported releases covers it, and how many targets it still has; the targets it lacks
follow, one line each.

Exit status: 0 when every newest release has every required target, 1 otherwise (or when a
release cannot be fetched); with ``--report`` always 0 (CI: ``.ci/run``), a release that cannot be
fetched (no index reachable) included.  ``--archives DIR`` checks the wheels and sdists already in
DIR instead of fetching (the newest of each runtime found there).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import re
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pkgindex  # scripts/pkgindex.py: the index in pip's configuration

ROOT = Path(__file__).resolve().parents[1]
PIP_TIMEOUT_S = 30
#: runtime -> the module holding its ``ALL_PATCHES``/``PATCHES`` and ``layout_patches(version)``
PATCH_MODULES = {
    "sglang": "kvcached_broker.adapters.sglang.patches",
    "vllm": "kvcached_broker.adapters.vllm.patches",
    "kvcached": "kvcached_broker.adapters.kvcached.patches",
}
_ARCHIVE = re.compile(r"^(?P<name>[A-Za-z0-9_.]+?)-(?P<version>\d[^-]*?)(?:-[^-]+-[^-]+-[^-]+\.whl|\.tar\.gz|\.zip)$")


# ------------------------------------------------------------------ a release's source, unpacked lazily
class Release:
    """One downloaded wheel or sdist: its modules' source, read on demand (never imported)."""

    def __init__(self, name: str, version: str, path: Path):
        self.name, self.version, self.path = name, version, path
        self._files = self._read(path)

    @staticmethod
    def _read(path: Path) -> dict[str, bytes]:
        if path.suffix == ".whl" or path.suffix == ".zip":
            with zipfile.ZipFile(path) as archive:
                return {n: archive.read(n) for n in archive.namelist() if n.endswith(".py")}
        files = {}
        with tarfile.open(path, "r:gz") as archive:
            for member in archive.getmembers():
                if member.isfile() and member.name.endswith(".py"):
                    handle = archive.extractfile(member)
                    if handle is not None:
                        files[member.name.split("/", 1)[1] if "/" in member.name else member.name] = handle.read()
        return files

    def is_package(self, module: str) -> bool:
        base = module.replace(".", "/")
        return f"{base}/__init__.py" in self._files or f"src/{base}/__init__.py" in self._files

    def source(self, module: str) -> str | None:
        """The source of ``module`` (``a.b.c``: ``a/b/c.py`` or ``a/b/c/__init__.py``, under a
        ``src/`` layout too); None if the release has no such module."""
        base = module.replace(".", "/")
        for candidate in (f"{base}.py", f"{base}/__init__.py", f"src/{base}.py", f"src/{base}/__init__.py"):
            if candidate in self._files:
                return self._files[candidate].decode("utf-8", "replace")
        return None


# ------------------------------------------------------------------ the static check
@dataclass
class Result:
    patch: str
    module: str
    target: str
    problem: str = ""  # empty: found as the patch needs it
    optional: bool = False


def _bindings(tree: ast.Module) -> dict[str, ast.AST]:
    """Module-level names: functions, classes, assignments and imports (the last binding wins)."""
    names: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    names[target.id] = node
        elif isinstance(node, (ast.If, ast.Try)):  # guarded definitions and imports count too
            inner = ast.Module(body=[*node.body, *getattr(node, "orelse", []),
                                     *(h for handler in getattr(node, "handlers", []) for h in handler.body)],
                               type_ignores=[])
            names.update(_bindings(inner))
    return names


class Checker:
    def __init__(self, releases: dict[str, Release]):
        self.releases = releases
        self._trees: dict[str, ast.Module | None] = {}
        self._packages: set[str] = set()

    def _tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            release = self.releases.get(module.split(".")[0])
            source = release.source(module) if release is not None else None
            if release is not None and release.is_package(module):
                self._packages.add(module)
            self._trees[module] = ast.parse(source) if source is not None else None
        return self._trees[module]

    def _resolve(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """The definition ``name`` is bound to in ``module``, following ``from ... import`` (up
        to 6 hops); (module, node), or None."""
        tree = self._tree(module)
        if tree is None or depth > 6:
            return None
        node = _bindings(tree).get(name)
        if isinstance(node, ast.ImportFrom):
            parts = module.split(".")
            if node.level:
                keep = len(parts) - node.level + (1 if module in self._packages else 0)
                base = ".".join(parts[:keep])
                source_module = f"{base}.{node.module}" if node.module else base
            else:
                source_module = node.module or ""
            original = next((a.name for a in node.names if (a.asname or a.name) == name), name)
            found = self._resolve(source_module, original, depth + 1)
            if found is None and self._tree(f"{source_module}.{original}") is not None:
                return f"{source_module}.{original}", node  # a submodule imported by name
            return found if found is not None else (module, node)
        return (module, node) if node is not None else None

    def check(self, module: str, symbol: str, params: tuple[str, ...]) -> str:
        """'' if ``symbol`` is in ``module`` as the patch needs it, else what is wrong."""
        if self._tree(module) is None:
            return "module missing"
        owner, _, member = symbol.rpartition(".")
        if not owner:
            found = self._resolve(module, symbol)
            if found is None:
                return f"no {symbol}"
            return self._params(found[1], params, symbol)
        found = self._resolve(module, owner)
        if found is None:
            return f"no class {owner}"
        cls = found[1]
        if isinstance(cls, ast.ImportFrom):
            return ""  # bound to something outside this release (another distribution): trust the binding
        if not isinstance(cls, ast.ClassDef):
            return f"{owner} is not a class"
        own = {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        own.update({t.id: n for n in cls.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)})
        if member not in own:
            return f"{owner} has no {member} of its own" + (" (inherited)" if cls.bases else "")
        return self._params(own[member], params, symbol)

    @staticmethod
    def _params(node: ast.AST, params: tuple[str, ...], symbol: str) -> str:
        if not params or not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return ""
        names = [a.arg for a in (*node.args.posonlyargs, *node.args.args)]
        if names[:len(params)] != list(params):
            return f"{symbol}({', '.join(names)}): expected ({', '.join(params)}, ...)"
        return ""


def check_runtime(runtime: str, version: str, checker: Checker) -> list[Result]:
    """Every target of the patches for ``version``'s module layout, checked in the releases."""
    patches = importlib.import_module(PATCH_MODULES[runtime])
    from kvcached_broker.adapters.patching import AnyOf

    results = []
    for patch in patches.layout_patches(version):
        if patch.module.split(".")[0] not in checker.releases:
            continue
        if not patch.targets:
            problem = "module missing" if checker._tree(patch.module) is None else ""
            results.append(Result(patch.name, patch.module, "(module)", problem, not patch.required))
        for target in patch.targets:
            if isinstance(target, AnyOf):
                problems = [checker.check(patch.module, t.symbol, t.params) for t in target.targets]
                problem = "" if "" in problems else "; ".join(problems)
                shown = " | ".join(t.symbol for t in target.targets)
                results.append(Result(patch.name, patch.module, shown, problem, not patch.required))
            else:
                results.append(Result(patch.name, patch.module, target.symbol,
                                      checker.check(patch.module, target.symbol, target.params),
                                      target.optional or not patch.required))
    return results


# ------------------------------------------------------------------ fetching the newest releases
def _parse_archive(path: Path) -> tuple[str, str] | None:
    match = _ARCHIVE.match(path.name)
    return (match.group("name").replace("_", "-").lower(), match.group("version")) if match else None


def newest_in(directory: Path, name: str) -> Path | None:
    from kvcached_broker.adapters.versions import parse

    found = [(parse(v), p) for p in directory.glob("*") if (parsed := _parse_archive(p)) and parsed[0] == name
             for v in [parsed[1]]]
    return max(found)[1] if found else None


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input",
                           "--timeout", str(PIP_TIMEOUT_S), "--retries", "1", *args],
                          capture_output=True, text=True, timeout=20 * PIP_TIMEOUT_S)


def newest_version(name: str) -> str:
    """The newest release of ``name`` on the index (``pip index versions``); RuntimeError if none."""
    out = _pip("index", "versions", name)
    match = re.search(rf"^{re.escape(name)} \(([^)]+)\)", out.stdout, re.M)
    if out.returncode != 0 or match is None:
        raise RuntimeError(_last_line(out.stderr) or f"pip index versions {name} found nothing")
    return match.group(1)


def fetch(name: str, directory: Path) -> Path:
    """The newest release of ``name`` in ``directory``, downloaded if it is not there yet."""
    version = newest_version(name)
    for existing in directory.glob("*"):
        if _parse_archive(existing) == (name, version):
            return existing
    out = _pip("download", "--no-deps", "--only-binary=:all:", "--dest", str(directory), f"{name}=={version}")
    if out.returncode == 0:
        found = newest_in(directory, name)
        if found is not None:
            return found
    # no wheel (kvcached): the sdist, from the simple index, unbuilt
    sdist = f"{name}-{version}.tar.gz"
    data = pkgindex.download_unpinned(name, sdist)
    (directory / sdist).write_bytes(data)
    return directory / sdist


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("WARNING: Location")]
    return lines[-1].strip() if lines else ""


# ------------------------------------------------------------------ the table
def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="canary.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", action="store_true", help="always exit 0 (CI)")
    parser.add_argument("--dir", type=Path, default=ROOT / ".canary", help="where releases are downloaded")
    parser.add_argument("--archives", type=Path, help="check the archives in this directory instead of fetching")
    args = parser.parse_args(argv)
    from kvcached_broker.adapters import support

    releases: dict[str, Release] = {}
    unfetched: dict[str, str] = {}
    for name in support.RUNTIMES:
        try:
            if args.archives is not None:
                path = newest_in(args.archives, name)
                if path is None:
                    raise RuntimeError(f"no {name} archive in {args.archives}")
            else:
                args.dir.mkdir(parents=True, exist_ok=True)
                path = fetch(name, args.dir)
            parsed = _parse_archive(path)
            assert parsed is not None
            releases[name] = Release(name, parsed[1], path)
        except (RuntimeError, OSError, subprocess.SubprocessError, pkgindex.FetchError, zipfile.BadZipFile,
                tarfile.TarError) as exc:
            unfetched[name] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    checker = Checker(releases)
    print(f"{'runtime':<9} {'newest':<14} {'supported':<22} {'in range':<9} {'targets':<9} verdict")
    problems: list[str] = []
    for name, runtime in support.RUNTIMES.items():
        if name in unfetched:
            print(f"{name:<9} {'?':<14} {str(runtime.supported):<22} {'?':<9} {'?':<9} not checked: {unfetched[name]}")
            continue
        release = releases[name]
        results = check_runtime(name, release.version, checker)
        missing = [r for r in results if r.problem and not r.optional]
        ok = sum(1 for r in results if not r.problem)
        covered = runtime.supports(release.version)
        if missing:
            verdict = f"INCOMPATIBLE: {len(missing)} targets missing"
        elif covered:
            verdict = "supported"
        else:
            verdict = "compatible: every target is there; add it to adapters/support.py once tested"
        print(f"{name:<9} {release.version:<14} {str(runtime.supported):<22} {'yes' if covered else 'NO':<9} "
              f"{f'{ok}/{len(results)}':<9} {verdict}")
        for r in results:
            if r.problem:
                kind = "optional" if r.optional else "missing"
                problems.append(f"  {name} {release.version}: {r.patch}: {r.module} {r.target}: {r.problem} ({kind})")
    for line in problems:
        print(line)
    failed = bool(unfetched) or any("(missing)" in line for line in problems)
    return 0 if args.report or not failed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
