"""The governors' thread: one per process, where every broker round trip and limit change runs.

It wakes when an engine call or a pressure ask says a pool needs attention (:func:`wake`),
and every ``TICK_S`` otherwise (idle give-back, kvctl writes, deferred limits that finished,
pages a restarted broker no longer charges).  A round runs the checks given to
:func:`first_in_every_round` (:func:`.pressure.check_shortfalls`, once a client's pools are
enlisted there), then steps every governor.  A failure in one check or one pool's step is
logged and never stops the others, nor reaches the runtime.

This module imports nothing else of kvcached mode: the modules above it give it their
governors and checks.  Once it steps governors, the worker's session lets it run a round before
it pins its base at what the device measures (:func:`..sessions.before_settling_warm_up`).  The
thread and what it steps are a part of the process registry (:class:`_Runner`): a reset ends
the thread, and the next :func:`enlist` starts another.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Callable, Protocol

from .. import announce, process_state, sessions

log = announce.logger("kvcached_broker.adapters")

TICK_S = 0.1


class Stepped(Protocol):
    """What the thread steps: a pool's governor (:class:`.governor.PoolGovernor`), or a
    broadcast-mode TP worker's grant holder (:class:`.broadcast.worker_grants.WorkerGrants`)."""

    @property
    def key(self) -> str: ...

    def step(self, now_s: float) -> None: ...

    def status(self) -> dict[str, Any] | None: ...


class _Runner:
    """This process's governors' thread and what it steps.

    Holds the governors (weakly), the checks run first in every round (check -> the event its
    failure logs, in the order given), the thread, and how many rounds it ran.  ``lock`` guards
    ``governors``, ``first`` and ``thread``; ``rounds_cond`` guards ``rounds``, which only
    grows.  Once closed, the thread ends after the round it is in (it is not started again:
    the next use builds a new part)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.governors: "weakref.WeakSet[Stepped]" = weakref.WeakSet()
        self.thread: threading.Thread | None = None
        self.first: dict[Callable[[], None], str] = {}
        self.rounds = 0
        self.rounds_cond = threading.Condition()
        self.closed = False

    def stop(self) -> None:
        """Have the thread end after the round it is in (never waits)."""
        self.closed = True
        self.wake.set()

    def close(self) -> None:
        """End the thread (after the round it is in), wait for it, and forget the governors."""
        self.stop()
        with self.lock:
            thread, self.thread = self.thread, None
            self.governors = weakref.WeakSet()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def loop(self) -> None:
        while not self.closed:
            self.wake.wait(TICK_S)
            self.wake.clear()
            if self.closed:
                return
            now = time.monotonic()
            with self.lock:
                first = list(self.first.items())
            for check, failure_event in first:
                try:
                    check()
                except Exception as exc:  # noqa: BLE001 - the runtime must never see a governor failure
                    log.warning("event=%s error=%r", failure_event, str(exc))
            with self.lock:
                stepped = list(self.governors)
            for governor in stepped:
                try:
                    governor.step(now)
                except Exception as exc:  # noqa: BLE001 - the runtime must never see a governor failure
                    log.warning("event=kvcached_governor_failed pool=%s error=%r", governor.key, str(exc))
            with self.rounds_cond:
                self.rounds += 1
                self.rounds_cond.notify_all()


def enlist(governor: Stepped) -> None:
    """Step ``governor`` on the thread (started on first use)."""
    sessions.before_settling_warm_up(_report_mapped)  # outside state.lock: no lock inside another; never waits on the broker
    state = process_state.part(_Runner)
    with state.lock:
        state.governors.add(governor)
        if state.thread is None or not state.thread.is_alive():
            state.thread = threading.Thread(target=state.loop, name="kvcached-broker-governor", daemon=True)
            state.thread.start()
    wake()


def _report_mapped() -> None:
    """Let the governors run a round first (when there are any), so that the broker knows every
    page they mapped: the base the worker pins next at what the device measures counts none."""
    if governors():
        settle(1, timeout_s=5.0)


def first_in_every_round(check: Callable[[], None], failure_event: str) -> None:
    """Run ``check`` at the start of every round, before the governors step (once per ``check``,
    however often given); an exception it raises is logged as ``event=<failure_event>``."""
    state = process_state.part(_Runner)
    with state.lock:
        state.first.setdefault(check, failure_event)


def governors() -> list[Stepped]:
    state = process_state.part(_Runner)
    with state.lock:
        return list(state.governors)


def wake() -> None:
    process_state.part(_Runner).wake.set()


def settle(rounds: int = 2, timeout_s: float = 30.0) -> bool:
    """Wait until the thread has run ``rounds`` more rounds (tests, shutdown); False on timeout."""
    state = process_state.part(_Runner)
    state.wake.set()
    with state.rounds_cond:
        target = state.rounds + rounds
        return state.rounds_cond.wait_for(lambda: state.rounds >= target, timeout=timeout_s)
