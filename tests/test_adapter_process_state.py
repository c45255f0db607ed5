"""The adapters' process state lives in one registry (adapters/process_state.py), nowhere else.

The first test reads every module of adapters/ and fails on module-level process state: a
``global`` statement, or a lower-case name bound at the top of a module to a lock, a container,
a thread, a socket or a counter.  Upper-case names are constant tables (never mutated).  The
others drive the registry itself: one part per process, reset, forget, fork and exit.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvcached_broker.adapters import process_state
from kvcached_broker.adapters.process_state import ProcessState

ADAPTERS = Path(__file__).resolve().parent.parent / "adapters"
REGISTRY = ADAPTERS / "process_state.py"
_STATEFUL_CALLS = {
    "Lock", "RLock", "Condition", "Event", "Semaphore", "BoundedSemaphore", "local", "Thread",
    "WeakSet", "WeakKeyDictionary", "WeakValueDictionary", "OrderedDict", "defaultdict", "deque",
    "count", "dict", "list", "set", "socket",
}
_CONTAINERS = (ast.Dict, ast.List, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)


def module_state(path: Path, name: str) -> list[str]:
    """``name:line: what`` for each piece of module-level process state in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    found = [f"{name}:{node.lineno}: global {', '.join(node.names)}"
             for node in ast.walk(tree) if isinstance(node, ast.Global)]
    for node in tree.body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        value = node.value
        called = value.func.attr if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) else \
            value.func.id if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) else ""
        stateful = called in _STATEFUL_CALLS or isinstance(value, _CONTAINERS)
        for bound in names:
            constant_table = bound.isupper() and isinstance(value, _CONTAINERS + (ast.Call,)) and called not in (
                "Lock", "RLock", "Condition", "Event", "Thread", "count", "socket", "local")
            if stateful and not constant_table and bound != "__all__":
                found.append(f"{name}:{node.lineno}: {bound} = {ast.unparse(value)[:50]}")
    return found


def test_no_adapter_module_keeps_process_state_outside_the_registry():
    found = [line for path in sorted(ADAPTERS.rglob("*.py")) if path != REGISTRY for line in module_state(path, str(path.relative_to(ADAPTERS)))]
    assert not found, "module-level process state (make it a part of adapters/process_state.py):\n" + "\n".join(found)


def test_the_checker_finds_each_kind_of_module_state(tmp_path):
    """The rule above fails on what it is meant to catch (so its silence means something)."""
    sample = tmp_path / "sample.py"
    sample.write_text(textwrap.dedent("""
        import itertools, threading, weakref
        TABLE = {"a": 1}
        _lock = threading.Lock()
        _seen: set[str] = set()
        _by_key = {}
        _live = weakref.WeakSet()
        _ids = itertools.count(1)
        LOCK = threading.RLock()
        def f():
            global _flag
            _flag = True
    """))
    found = "\n".join(module_state(sample, "sample.py"))
    for name in ("_lock", "_seen", "_by_key", "_live", "_ids", "LOCK", "global _flag"):
        assert name in found
    assert "TABLE" not in found


class _Thing:
    built = 0

    def __init__(self):
        type(self).built += 1
        self.closed = False
        self.items: list[int] = []

    def close(self):
        self.closed = True


class _Wiring:
    KEPT_ACROSS_RESET = True

    def __init__(self):
        self.items: list[int] = []


def test_a_part_is_built_once_and_reset_builds_it_again_closing_the_old_one():
    registry = ProcessState()
    _Thing.built = 0
    first = registry.part(_Thing)
    assert registry.part(_Thing) is first and _Thing.built == 1
    wiring = registry.part(_Wiring)
    registry.reset()
    assert first.closed
    assert registry.built(_Thing) is None
    assert registry.part(_Wiring) is wiring  # the hook's wiring outlives a reset
    again = registry.part(_Thing)
    assert again is not first and again.items == [] and _Thing.built == 2


def test_forget_drops_one_part_only():
    registry = ProcessState()
    thing, wiring = registry.part(_Thing), registry.part(_Wiring)
    registry.forget(_Thing)
    assert thing.closed and registry.built(_Thing) is None and registry.part(_Wiring) is wiring
    registry.forget(_Thing)  # not built: nothing to do


def test_process_reset_leaves_the_hooks_wiring():
    process_state.part(_Wiring).items.append(1)
    process_state.reset()
    assert process_state.part(_Wiring).items == [1]
    process_state.forget(_Wiring)
    assert process_state.registry().built(_Wiring) is None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_tells_its_parts_and_exit_runs_them_newest_first():
    """A real fork and a real interpreter exit: the child's part hears ``after_fork_in_child``
    (the parent's does not), and at exit each part's ``at_exit`` runs, newest first."""
    script = textwrap.dedent("""
        import os, sys
        from kvcached_broker.adapters import process_state

        class Older:
            def __init__(self): self.forked = False
            def after_fork_in_child(self): self.forked = True
            def at_exit(self): print("exit older", flush=True)

        class Newer:
            def at_exit(self): print("exit newer", flush=True)

        older = process_state.part(Older)
        process_state.part(Newer)
        pid = os.fork()
        if pid == 0:
            print("child forked", process_state.part(Older).forked, flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        print("parent forked", older.forked, flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.splitlines() == ["child forked True", "parent forked False", "exit newer", "exit older"]
