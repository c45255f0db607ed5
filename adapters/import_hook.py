"""Run code right after a module is imported (the patches' trigger).

A ``sys.meta_path`` finder that, for watched module names only, lets the normal finders find
the module and wraps its loader so that the registered callbacks run after the module body.
A module imported before the hook was installed gets its callbacks at once.  Nothing here
imports the runtime itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from types import ModuleType
from typing import Callable

from . import process_state

#: ``callback(module)``; what it returns is ignored.
Callback = Callable[[ModuleType], object]


class _Watched:
    """The callbacks waiting for each module name, in the order given, and the finder that runs
    them (hook wiring: a reset leaves them, since the patches they apply describe classes
    already patched)."""

    KEPT_ACROSS_RESET = True

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.callbacks: dict[str, list[Callback]] = {}
        self.finder = _PostImportFinder(self.callbacks)


def watched() -> dict[str, list[Callback]]:
    """Module name -> the callbacks waiting for it (tests read and extend it)."""
    return process_state.part(_Watched).callbacks


class _PostImportLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _run(module.__name__, module)

    def __getattr__(self, name):  # get_source, is_package, ... for tools that ask
        return getattr(self._inner, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self, watched: dict[str, list[Callback]]) -> None:
        self._watched = watched  # its part's callbacks: read on every import, with no lookup
        self._busy = threading.local()  # this thread is inside find_spec: let the others find

    def find_spec(self, fullname, path, target=None):
        if fullname not in self._watched or getattr(self._busy, "active", False):
            return None
        self._busy.active = True
        try:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
            if spec is None:
                for finder in sys.meta_path:
                    if finder is self or not hasattr(finder, "find_spec"):
                        continue
                    spec = finder.find_spec(fullname, path, target)
                    if spec is not None:
                        break
        finally:
            self._busy.active = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PostImportLoader(spec.loader)
        return spec


def when_imported(module_name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once ``module_name`` is imported (now, if it already is)."""
    state = process_state.part(_Watched)
    with state.lock:
        if state.finder not in sys.meta_path:
            sys.meta_path.insert(0, state.finder)
        state.callbacks.setdefault(module_name, []).append(callback)
        module = sys.modules.get(module_name)
    if module is not None and getattr(module, "__spec__", None) is not None and not _initialising(module):
        callback(module)


def _initialising(module: ModuleType) -> bool:
    return bool(getattr(module.__spec__, "_initializing", False))


def _run(name: str, module: ModuleType) -> None:
    state = process_state.part(_Watched)
    with state.lock:
        callbacks = list(state.callbacks.get(name, ()))
    for callback in callbacks:
        callback(module)
