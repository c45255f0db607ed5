"""What the adapters keep for one process, in one registry: the only process state they hold.

Rules (kept by ``tests/test_adapter_process_state.py``, which reads every module of adapters/):

* An adapter module keeps no process state at module level: no ``global`` statement, and no
  lock, container, thread or socket assigned at the top of a module.  It declares a *part*, a
  class whose constructor takes no argument, and reads the process's one instance of it with
  :func:`part`.  Constants, loggers and the adapter's one log handler are not state.
* A part is built on first use, once per process, under the registry's lock; it holds its own
  lock for its own fields.
* :func:`reset` closes every part that has a ``close()`` (newest first), then forgets them all:
  the next use builds each again, empty (tests; a worker shutting down).  A part that owns a
  broker session, a thread or a socket closes it there; a thread whose part was closed ends.
  :func:`forget` does the same for one part.  The hook's own wiring (patches registered,
  callbacks waiting for a module, what each patch did) describes classes already patched, so
  its parts say ``KEPT_ACROSS_RESET = True`` and a reset leaves them.
* After ``fork``, in the child, every part that has an ``after_fork_in_child()`` is told: a part
  whose fields name the parent (its sessions, slots, sockets, locks that another thread held at
  the fork) drops or rebuilds them there, since the child cannot use them.  A part without
  that method keeps its fields, as a forked child's copy of memory does.
* At interpreter exit every part that has an ``at_exit()`` is told (newest first; the exit
  handler is registered when the first such part is built, so it runs before the handlers of
  what was imported earlier): grants are given back, board slots left.  A failure there is the part's own to log; it never stops the
  others.

The registry is created when this module is imported, which the start-up hook does first
(:mod:`.autopatch`, from the ``.pth`` file), so the hook owns it.
"""

from __future__ import annotations

import atexit
import os
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
        """Close this process's ``kind`` if it was built, and forget it."""
        with self._lock:
            found = self._parts.pop(kind, None)
        _close(found)

    def reset(self) -> None:
        """Close every part but the hook's wiring (newest first) and forget them."""
        with self._lock:
            parts = [found for found in self._parts.values() if not getattr(found, "KEPT_ACROSS_RESET", False)]
            for found in parts:
                del self._parts[type(found)]
        for found in reversed(parts):
            _close(found)

    def after_fork_in_child(self) -> None:
        self._lock = threading.RLock()
        for found in list(self._parts.values()):
            hook = getattr(found, "after_fork_in_child", None)
            if hook is not None:
                hook()

    def at_exit(self) -> None:
        with self._lock:
            parts = list(self._parts.values())
        for found in reversed(parts):
            hook = getattr(found, "at_exit", None)
            if hook is not None:
                hook()


def _close(found: object) -> None:
    close = getattr(found, "close", None)
    if close is not None:
        close()


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
