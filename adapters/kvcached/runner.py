"""The governors' thread: one per process, where every broker round trip and limit change runs.

It wakes when an engine call or a pressure ask says a pool needs attention (:func:`wake`),
and every ``TICK_S`` otherwise (idle give-back, kvctl writes, deferred limits that finished,
pages a restarted broker no longer charges).  A round runs the checks given to
:func:`first_in_every_round` (:func:`.pressure.check_shortfalls`, once a client's pools are
enlisted there), then steps every governor.  A failure in one check or one pool's step is
logged and never stops the others, nor reaches the runtime.

This module imports nothing else of kvcached mode: the modules above it give it their
governors and checks.  Once it steps governors, the worker's session lets it run a round before
it pins its base at what the device measures (:func:`worker.before_settling_warm_up`).
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Callable

from .. import announce, worker

log = announce.logger("kvcached_broker.adapters")

TICK_S = 0.1

_lock = threading.Lock()
_wake = threading.Event()
_governors: "weakref.WeakSet" = weakref.WeakSet()
_thread: threading.Thread | None = None
_first: dict[Callable[[], None], str] = {}  # check -> the event its failure logs, in order given
_rounds = 0
_rounds_cond = threading.Condition()


def enlist(governor) -> None:
    """Step ``governor`` on the thread (started on first use)."""
    global _thread
    worker.before_settling_warm_up(_report_mapped)  # outside _lock: no lock is taken inside another; never waits on the broker
    with _lock:
        _governors.add(governor)
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_loop, name="kvcached-broker-governor", daemon=True)
            _thread.start()
    wake()


def _report_mapped() -> None:
    """Let the governors run a round first (when there are any), so that the broker knows every
    page they mapped: the base the worker pins next at what the device measures counts none."""
    if governors():
        settle(1, timeout_s=5.0)


def first_in_every_round(check: Callable[[], None], failure_event: str) -> None:
    """Run ``check`` at the start of every round, before the governors step (once per ``check``,
    however often given); an exception it raises is logged as ``event=<failure_event>``."""
    with _lock:
        _first.setdefault(check, failure_event)


def governors() -> list:
    with _lock:
        return list(_governors)


def wake() -> None:
    _wake.set()


def _loop() -> None:
    global _rounds
    while True:
        _wake.wait(TICK_S)
        _wake.clear()
        now = time.monotonic()
        with _lock:
            first = list(_first.items())
        for check, failure_event in first:
            try:
                check()
            except Exception as exc:  # noqa: BLE001 - the runtime must never see a governor failure
                log.warning("event=%s error=%r", failure_event, str(exc))
        for governor in governors():
            try:
                governor.step(now)
            except Exception as exc:  # noqa: BLE001 - the runtime must never see a governor failure
                log.warning("event=kvcached_governor_failed pool=%s error=%r", getattr(governor, "key", "?"), str(exc))
        with _rounds_cond:
            _rounds += 1
            _rounds_cond.notify_all()


def settle(rounds: int = 2, timeout_s: float = 30.0) -> bool:
    """Wait until the thread has run ``rounds`` more rounds (tests, shutdown); False on timeout."""
    wake()
    with _rounds_cond:
        target = _rounds + rounds
        return _rounds_cond.wait_for(lambda: _rounds >= target, timeout=timeout_s)
