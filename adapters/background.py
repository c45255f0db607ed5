"""Broker round trips taken off a path that must not wait or fail: one thread, never raising.

Some adapter work is triggered where a broker round trip must not happen: inside a forward
pass (SGLang's DSV4.1 request window grows its workspace there), or in a garbage-collection
finaliser (which may run in the middle of a request on the very session it would use).
:func:`submit` queues such work under a key; one daemon thread runs it in order, and a key
queued again before it ran is run once, with the latest function.  A failure is logged and
dropped: it never reaches the runtime.

:func:`drain` waits until everything queued so far has run (tests, shutdown).  A reset of the
process's state drops what is still queued (its sessions are closed with it) and ends the thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable
from . import announce, process_state

log = announce.logger("kvcached_broker.adapters")

class _Queue:
    """The queued work, by key in the order queued, the count of works running, and the thread
    that runs them (started on first use; :meth:`stop` drops what is queued and ends it after
    the work it runs, :meth:`close` waits for that)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.pending: OrderedDict[str, Callable[[], None]] = OrderedDict()
        self.running = 0
        self.thread: threading.Thread | None = None
        self.closed = False

    def stop(self) -> None:
        with self.cond:
            self.closed = True
            self.pending.clear()
            self.cond.notify_all()

    def close(self) -> None:
        self.stop()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()


def submit(key: str, work: Callable[[], None]) -> None:
    """Run ``work`` soon on the adapter's background thread (replacing a queued ``key``)."""
    queue = process_state.part(_Queue)
    with queue.cond:
        queue.pending[key] = work
        queue.pending.move_to_end(key)
        if queue.thread is None or not queue.thread.is_alive():
            try:
                queue.thread = threading.Thread(target=_loop, args=(queue,), name="kvcached-broker-background",
                                                daemon=True)
                queue.thread.start()
            except RuntimeError:  # interpreter shutdown: the session closes anyway
                queue.pending.pop(key, None)
                return
        queue.cond.notify_all()


def _loop(queue: _Queue) -> None:
    while True:
        with queue.cond:
            while not queue.pending and not queue.closed:
                queue.cond.wait()
            if queue.closed:
                return
            key, work = queue.pending.popitem(last=False)
            queue.running += 1
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - background work must never reach the runtime
            log.warning("event=background_failed work=%s error=%r", key, str(exc))
        finally:
            with queue.cond:
                queue.running -= 1
                queue.cond.notify_all()


def drain(timeout_s: float = 30.0) -> bool:
    """Wait until nothing is queued or running; False if that took longer than ``timeout_s``."""
    queue = process_state.part(_Queue)
    with queue.cond:
        return queue.cond.wait_for(lambda: not queue.pending and not queue.running, timeout=timeout_s)
