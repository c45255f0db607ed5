"""Broker round trips taken off a path that must not wait or fail: one thread, never raising.

Some adapter work is triggered where a broker round trip must not happen: inside a forward
pass (SGLang's DSV4.1 request window grows its workspace there), or in a garbage-collection
finaliser (which may run in the middle of a request on the very session it would use).
:func:`submit` queues such work under a key; one daemon thread runs it in order, and a key
queued again before it ran is run once, with the latest function.  A failure is logged and
dropped: it never reaches the runtime.

:func:`drain` waits until everything queued so far has run (tests, shutdown).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable
from . import announce

log = announce.logger("kvcached_broker.adapters")

_cond = threading.Condition()
_pending: OrderedDict[str, Callable[[], None]] = OrderedDict()
_running = 0
_thread: threading.Thread | None = None


def submit(key: str, work: Callable[[], None]) -> None:
    """Run ``work`` soon on the adapter's background thread (replacing a queued ``key``)."""
    global _thread
    with _cond:
        _pending[key] = work
        _pending.move_to_end(key)
        if _thread is None or not _thread.is_alive():
            try:
                _thread = threading.Thread(target=_loop, name="kvcached-broker-background", daemon=True)
                _thread.start()
            except RuntimeError:  # interpreter shutdown: the session closes anyway
                _pending.pop(key, None)
                return
        _cond.notify_all()


def _loop() -> None:
    global _running
    while True:
        with _cond:
            while not _pending:
                _cond.wait()
            key, work = _pending.popitem(last=False)
            _running += 1
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - background work must never reach the runtime
            log.warning("event=background_failed work=%s error=%r", key, str(exc))
        finally:
            with _cond:
                _running -= 1
                _cond.notify_all()


def drain(timeout_s: float = 30.0) -> bool:
    """Wait until nothing is queued or running; False if that took longer than ``timeout_s``."""
    with _cond:
        return _cond.wait_for(lambda: not _pending and not _running, timeout=timeout_s)
