"""The package's import graph: no cycles, and the floors docs/design.md states.

Read from the sources with :mod:`ast` (nothing is imported): every ``import`` and ``from ...
import`` of every module of broker/, client/, adapters/ and tools/, at the top level and inside
functions and ``if TYPE_CHECKING:`` blocks alike, since a lazy import that only dodges a cycle
is still the cycle.  ``from pkg import name`` is an edge to the submodule ``pkg.name`` when
there is one, else to ``pkg``.  Importing a module also runs the ``__init__`` of each package
above it, so that is an edge too, but only to the packages the importer is not inside: for a
module inside a package, that package's ``__init__`` has already begun (counting it would put
every package that re-exports a submodule in a cycle with it by construction).

A module imported by name is an edge too (a registry of modules, the client's lazy re-exports):
in a module that calls ``importlib.import_module`` or ``__import__``, every string that names a
module of the package (``"kvcached_broker.adapters.sglang.patches"``, or ``".sync_client"``
relative to the module's package) is an import of it, wherever the string is written (a table
the call reads, the call itself).  A logger's name (the argument of ``logger``/``getLogger``),
which is often a package's name, is not.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "kvcached_broker"
FOLDERS = ("broker", "client", "adapters", "tools")

def _modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the installed package."""
    found: dict[str, Path] = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([PACKAGE, *parts])] = path
    return found


def _imported(module: str, path: Path, modules: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """(imported project module, line) for every import statement in ``path``, and every module
    it imports by name."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    yield from _imported_by_name(tree, package, modules)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not (target == PACKAGE or target.startswith(PACKAGE + ".")):
                continue
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in modules:
                    yield submodule, node.lineno
                elif target in modules:
                    yield target, node.lineno
                else:
                    raise AssertionError(f"{path}:{node.lineno}: {target} is not a module of the package")


_BY_NAME = ("import_module", "__import__")
_LOGGER = ("logger", "getLogger")


def _called(node: ast.Call) -> str:
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _imported_by_name(tree: ast.Module, package: str, modules: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """(project module, line) for each string naming one, in a module that imports by name."""
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]
    if not any(_called(call) in _BY_NAME for call in calls):
        return
    loggers = {id(arg) for call in calls if _called(call) in _LOGGER for arg in call.args}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in loggers:
            continue
        name = f"{package}{node.value}" if node.value.startswith(".") else node.value
        if name in modules:
            yield name, node.lineno


def _packages_run(importer: str, target: str, modules: dict[str, Path]) -> Iterator[str]:
    """``target`` and the packages above it whose ``__init__`` importing it runs: those
    ``importer`` is not inside."""
    parts = target.split(".")
    for depth in range(2, len(parts)):
        package = ".".join(parts[:depth])
        if package in modules and not importer.startswith(package + "."):
            yield package
    yield target


def _graph() -> dict[str, dict[str, int]]:
    """Module -> {imported module: line of its first import}."""
    modules = _modules()
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for target, line in _imported(module, path, modules):
            for imported in _packages_run(module, target, modules):
                if imported != module:
                    edges.setdefault(imported, line)
    return graph


def _short(module: str) -> str:
    return module[len(PACKAGE) + 1:]


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def _describe(component: list[str], graph: dict[str, dict[str, int]]) -> str:
    """The component's modules and every import between two of them, with its line."""
    members = set(component)
    edges = [f"    {_short(source)} -> {_short(target)} (line {line})"
             for source in component for target, line in sorted(graph[source].items()) if target in members]
    return "cycle of " + ", ".join(map(_short, component)) + ":\n" + "\n".join(edges)


def _floor(module: str) -> str:
    return module.split(".")[1]


def test_the_finder_sees_the_package():
    graph = _graph()
    assert f"{PACKAGE}.broker.server" in graph and f"{PACKAGE}.adapters.device_session" in graph
    # A relative import resolved: adapters/kvcached/__init__.py imports its sibling `.identity`.
    assert f"{PACKAGE}.adapters.kvcached.identity" in graph[f"{PACKAGE}.adapters.kvcached"]
    # `from . import protocol as proto` imports the submodule, not the package re-exporting the client.
    assert f"{PACKAGE}.client.protocol" in graph[f"{PACKAGE}.client.async_client"]
    assert f"{PACKAGE}.client" not in graph[f"{PACKAGE}.client.async_client"]
    # Importing a module from outside its package runs the package's __init__ first.
    assert f"{PACKAGE}.client" in graph[f"{PACKAGE}.adapters.device_session"]


def test_the_finder_sees_imports_by_name():
    graph = _graph()
    # autopatch.RUNTIMES names the runtimes' patch modules it imports with importlib.
    assert f"{PACKAGE}.adapters.sglang.patches" in graph[f"{PACKAGE}.adapters.autopatch"]
    # The client's lazy re-exports, relative to the package.
    assert f"{PACKAGE}.client.sync_client" in graph[f"{PACKAGE}.client"]
    # A logger named after a package is not an import of it.
    assert f"{PACKAGE}.adapters" not in graph[f"{PACKAGE}.adapters.autopatch"]


def test_the_finder_finds_a_cycle():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}, "e": {"e": 5}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles():
    graph = _graph()
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(_describe(c, graph) for c in cycles)


def test_the_floors_of_docs_design():
    """docs/design.md: "`client/` imports nothing else of the project"; "`broker/` and
    `adapters/` stand on `client/` and never import each other"."""
    crossing = sorted(
        f"{source} -> {target} (line {line})"
        for source, edges in _graph().items()
        for target, line in edges.items()
        if (_floor(source) == "client" and _floor(target) != "client")
        or {_floor(source), _floor(target)} == {"broker", "adapters"}
    )
    assert crossing == []


def _lines_inside_functions(path: Path) -> set[int]:
    """The lines of the import statements of ``path`` that sit inside a function."""
    lines: set[int] = set()
    for function in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines.update(node.lineno for node in ast.walk(function) if isinstance(node, (ast.Import, ast.ImportFrom)))
    return lines


def test_the_tools_floor_of_docs_design():
    """docs/design.md: "`tools/` stands on all three: `client/`, `broker/` ... and `adapters/`";
    "Nothing but the broker's CLI imports a tool, and the CLI only inside the function of the
    subcommand that runs it"."""
    modules = _modules()
    graph = _graph()
    stands_on = {_floor(target) for source, edges in graph.items() if _floor(source) == "tools" for target in edges}
    assert stands_on - {"tools"} == {"client", "broker", "adapters"}
    reaching = sorted(
        f"{_short(module)} -> {_short(target)} (line {line})"
        for module, path in modules.items() if _floor(module) != "tools"
        for target, line in _imported(module, path, modules)
        if _floor(target) == "tools"
        and not (module == f"{PACKAGE}.broker.cli" and line in _lines_inside_functions(path))
    )
    assert reaching == []
    assert f"{PACKAGE}.tools.demo" in graph[f"{PACKAGE}.broker.cli"]  # the check sees the CLI's imports
