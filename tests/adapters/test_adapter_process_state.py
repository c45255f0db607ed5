"""The adapters' process state lives in one registry (adapters/process_state.py), nowhere else.

The first test reads every module of adapters/ and fails on module-level process state: a
``global`` statement; a name bound at the top of a module (or in a class body) to a lock, a
thread, a socket, a thread-local or a counter; a lower-case name bound to a container; or any
name bound to an object built by a call that makes no constant (an instance of the module's
own class holds state as well as a dict does).  Upper-case names bound to container literals
are constant tables (never mutated).  The others drive the registry itself: one part per
process, reset (threads stopped first, parts registered while they close, a failing close
stopping nothing), forget, fork and exit.
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

ADAPTERS = Path(__file__).resolve().parents[2] / "adapters"
REGISTRY = ADAPTERS / "process_state.py"
_STATEFUL_CALLS = {
    "Lock", "RLock", "Condition", "Event", "Semaphore", "BoundedSemaphore", "local", "Thread",
    "WeakSet", "WeakKeyDictionary", "WeakValueDictionary", "OrderedDict", "defaultdict", "deque",
    "count", "dict", "list", "set", "socket",
}
#: Calls whose result is a constant: a logger (no state of its own), a frozenset, a compiled
#: pattern or struct layout, a type variable, the frozen records of the support table and the
#: one-rank group; the adapters' log handler (it writes to the current stderr, holding nothing).
_CONSTANT_CALLS = {"logger", "frozenset", "tuple", "compile", "Struct", "TypeVar", "Runtime", "RankGroup",
                   "_StderrHandler"}
_CONTAINERS = (ast.Dict, ast.List, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)


def _called(value: ast.expr) -> str:
    if not isinstance(value, ast.Call):
        return ""
    func = value.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else "?"


def module_state(path: Path, name: str) -> list[str]:
    """``name:line: what`` for each piece of module-level process state in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    found = [f"{name}:{node.lineno}: global {', '.join(node.names)}"
             for node in ast.walk(tree) if isinstance(node, ast.Global)]
    bodies = [(tree.body, True)] + [(node.body, False) for node in tree.body if isinstance(node, ast.ClassDef)]
    for body, top in bodies:
        for node in body:
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value, called = node.value, _called(node.value)
            for bound in [t.id for t in targets if isinstance(t, ast.Name)]:
                if called in _STATEFUL_CALLS - {"dict", "list", "set"}:
                    stateful = True
                elif not top:
                    continue  # a class body's containers are dataclass defaults (field(default_factory=...))
                elif isinstance(value, _CONTAINERS) or called in ("dict", "list", "set"):
                    stateful = not bound.isupper() and bound != "__all__"
                else:
                    stateful = bool(called) and called not in _CONSTANT_CALLS
                if stateful:
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
        SHARED = Registry()
        class Finder:
            busy = threading.local()
        def f():
            global _flag
            _flag = True
    """))
    found = "\n".join(module_state(sample, "sample.py"))
    for name in ("_lock", "_seen", "_by_key", "_live", "_ids", "LOCK", "SHARED", "busy", "global _flag"):
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


def test_a_reset_stops_the_threads_first_and_every_part_is_registered_while_it_closes():
    """A part with ``stop()`` (one that runs a thread) is stopped, then closed, before the other
    parts close: nothing steps them meanwhile.  A ``close()`` that reads another part gets the
    one being reset, never a fresh empty one that would outlive the reset."""
    registry = ProcessState()
    order: list[str] = []

    class Sessions:
        def __init__(self):
            self.open = True

        def close(self):
            order.append("sessions closed")
            self.open = False

    class Holders:
        def __init__(self):
            self.sessions = registry.part(Sessions)

        def close(self):
            seen = registry.part(Sessions)  # gives back through the session, if still open
            order.append(f"holders closed (same sessions: {seen is self.sessions}, open: {seen.open})")

    class Thread:
        def stop(self):
            order.append("thread stopped")

        def close(self):
            order.append("thread joined")

    registry.part(Thread)
    sessions = registry.part(Sessions)
    registry.part(Holders)
    registry.reset()
    assert order == ["thread stopped", "thread joined", "holders closed (same sessions: True, open: True)",
                     "sessions closed"]
    assert registry.built(Sessions) is None and registry.built(Holders) is None and registry.built(Thread) is None
    assert registry.part(Sessions) is not sessions


def test_a_close_that_fails_stops_no_other_and_the_reset_says_so(capfd):
    registry = ProcessState()
    closed: list[str] = []

    class Broken:
        def close(self):
            raise RuntimeError("socket already gone")

    class After:
        def close(self):
            closed.append("after")

    class Before:
        def close(self):
            closed.append("before")

    registry.part(Before)
    registry.part(Broken)
    registry.part(After)
    with pytest.raises(RuntimeError, match="socket already gone"):
        registry.reset()
    assert closed == ["after", "before"]  # newest first, past the failure
    assert all(registry.built(kind) is None for kind in (Before, Broken, After))  # all forgotten
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "event=process_state_failed" in err and "Broken.close" in err
