"""What the adapters keep for one process, in one registry: the only process state they hold.

Rules (kept by ``tests/adapters/test_adapter_process_state.py``, which reads every module of adapters/):

* An adapter module keeps no process state at module level: no ``global`` statement, and no
  lock, container, thread, socket, counter or object of its own bound at the top of a module
  or in a class body.  It declares a *part*, a class whose constructor takes no argument, and
  reads the process's one instance of it with :func:`part`.  Constant tables, loggers and the
  adapters' one log handler (it holds nothing) are not state.
* A part is built on first use, once per process, under the registry's lock; it holds its own
  lock for its own fields.
* :func:`reset` closes every part but the hook's wiring, then forgets them: the next use
  builds each again, empty (tests; a worker shutting down).  A part that runs a thread has a
  ``stop()`` that signals it and never blocks, and a ``close()`` that joins it: a reset stops
  every such part first, closes them next (so nothing steps the other parts while they
  close), then closes the rest, newest first.  Parts stay registered while they close: what a
  ``close()`` calls reads the parts being closed, never a fresh empty one.  A ``close()`` that
  raises does not stop the others; the reset raises the first error once every part is closed
  and forgotten.  :func:`forget` stops and closes one part.  The hook's own wiring (patches
  registered, callbacks waiting for a module, what each patch did, the subclasses and wrappers
  patched classes hold) describes classes already patched, so its parts say
  ``KEPT_ACROSS_RESET = True`` and a reset leaves them.
* After ``fork``, in the child, every part that has an ``after_fork_in_child()`` is told (the
  board slots, grants and doorbell socket that name the parent are dropped there).  A part
  without that method keeps its fields, as a forked child's copy of memory does: it must not
  be used across a fork with its threads or sockets live (vLLM forks its workers before any
  session, governor or queue exists).
* At interpreter exit every part that has an ``at_exit()`` is told (newest first; the exit
  handler is registered when the first such part is built, so it runs before the handlers of
  what was imported earlier): grants are given back, board slots left.  A failure there is
  written as one line on stderr and never stops the others.

The registry is created when this module is imported, which the start-up hook does first
(:mod:`.autopatch`, from the ``.pth`` file), so the hook owns it.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import TypeVar

T = TypeVar("T")


class ProcessState:
    """The parts of one process, by class, in the order they were built."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._parts: dict[type, object] = {}
        self._exit_registered = False

    def part(self, kind: type[T]) -> T:
        """This process's one ``kind`` (built now if it was not yet)."""
        found = self._parts.get(kind)  # a dict read is atomic: no lock once built
        if found is None:
            with self._lock:
                found = self._parts.get(kind)
                if found is None:
                    found = self._parts[kind] = kind()
                    if hasattr(found, "at_exit") and not self._exit_registered:
                        atexit.register(self.at_exit)  # when first needed: after the runtime's own
                        self._exit_registered = True
        return found  # type: ignore[return-value]

    def built(self, kind: type[T]) -> T | None:
        """This process's ``kind`` if some use built it, else None (never builds one)."""
        return self._parts.get(kind)  # type: ignore[return-value]

    def forget(self, kind: type) -> None:
        """Stop and close this process's ``kind`` if it was built, and forget it."""
        found = self._parts.get(kind)
        if found is not None:
            self._retire([found])

    def reset(self) -> None:
        """Stop the parts that run threads, close them, close the rest newest first (every
        part still registered meanwhile), then forget them all; the hook's wiring stays.  Raises
        the first error a ``close()`` raised, once every part is closed and forgotten."""
        with self._lock:
            parts = [found for found in reversed(self._parts.values())
                     if not getattr(found, "KEPT_ACROSS_RESET", False)]
        self._retire(parts)

    def _retire(self, parts: list[object]) -> None:
        """Stop ``parts`` that run threads, close those first, then the others in the order
        given, and forget them all; the first error a close raised, raised after."""
        running = [found for found in parts if hasattr(found, "stop")]
        try:
            _call_each(running, "stop")
            error = _call_each(running + [found for found in parts if found not in running], "close")
        finally:
            self._drop(parts)
        if error is not None:
            raise error

    def _drop(self, parts: list[object]) -> None:
        with self._lock:
            for found in parts:
                if self._parts.get(type(found)) is found:
                    del self._parts[type(found)]

    def after_fork_in_child(self) -> None:
        self._lock = threading.RLock()
        _call_each(list(self._parts.values()), "after_fork_in_child")

    def at_exit(self) -> None:
        with self._lock:
            parts = list(reversed(self._parts.values()))
        _call_each(parts, "at_exit")


def _call_each(parts: list[object], method: str) -> Exception | None:
    """Call ``method`` on each part that has it, whatever the others do (each failure one line
    on stderr); the first error."""
    first: Exception | None = None
    for found in parts:
        call = getattr(found, method, None)
        if call is None:
            continue
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - one part's failure never stops the others
            _report(exc, f"{type(found).__name__}.{method}")
            first = first or exc
    return first


def _report(error: Exception, where: str) -> None:
    try:
        sys.stderr.write(f"kvcached-broker: WARNING event=process_state_failed where={where} error={str(error)!r}\n")
    except Exception:  # noqa: BLE001 - a closed stderr at exit
        pass


_PROCESS = ProcessState()
os.register_at_fork(after_in_child=_PROCESS.after_fork_in_child)


def registry() -> ProcessState:
    """This process's registry."""
    return _PROCESS


def part(kind: type[T]) -> T:
    """This process's one ``kind`` (built now if it was not yet)."""
    return _PROCESS.part(kind)


def forget(kind: type) -> None:
    """Close and forget this process's ``kind`` (the next use builds it again, empty)."""
    _PROCESS.forget(kind)


def reset() -> None:
    """Close and forget every part of this process but the hook's wiring (tests; a worker
    shutting down)."""
    _PROCESS.reset()
