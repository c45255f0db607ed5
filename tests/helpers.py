"""Constants and small helpers shared by the tests (import as ``from helpers import ...``)."""

from __future__ import annotations

import os
import time

GIB = 1 << 30
MIB = 1 << 20


def wait_for(predicate, timeout_s: float = 60.0, interval_s: float = 0.01, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value; fail the test after ``timeout_s``.

    The timeout only bounds a failure (generous, so a loaded machine does not fail the suite);
    the test goes on as soon as the condition holds."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last value: {last!r})")


def python_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("KVCACHED_BROKER", None)
    return env


def connect_to(endpoint: str, credit_pages: int | None = 0):
    """A ``worker.client_factory`` that opens adapter sessions on ``endpoint`` (adapter tests).

    It opens them as the adapter does (``worker.connect``: the adapter identity included),
    only with the endpoint fixed.
    """
    import dataclasses

    from kvcached_broker.adapters import worker

    def factory(identity):
        return worker.connect(dataclasses.replace(identity, credit_pages=credit_pages), endpoint=endpoint)

    return factory


def require_runtime(dist: str) -> str:
    """The installed version of ``dist`` for the adapter tests (scripts/test-adapters.sh).

    ``KVCACHED_BROKER_TEST_RUNTIME`` names the overlay being run (``sglang-0.5.23``); inside
    one, the runtime must be importable at exactly that version (a missing runtime fails, it
    is not skipped).  Without it (a plain ``pytest`` run) the adapter tests are skipped.
    """
    from importlib.metadata import PackageNotFoundError, version

    import pytest

    expected = os.environ.get("KVCACHED_BROKER_TEST_RUNTIME", "")
    try:
        found = version(dist)
    except PackageNotFoundError:
        found = None
    if expected.startswith(dist + "-"):
        want = expected[len(dist) + 1 :]
        assert found == want, f"overlay {expected} expected {dist} {want}, found {found}"
    elif found is None or not expected:
        pytest.skip(f"{dist} adapter tests run inside an overlay (make test-adapters)")
    return found


class FakeProcesses:
    """``ProcessOps`` for driving the request core without processes: every pid is alive unless
    listed in ``dead``; kills and watches are recorded."""

    def __init__(self) -> None:
        self.dead: set[int] = set()
        self.killed: list[int] = []
        self.watched: set[int] = set()

    def start_ticks(self, pid: int) -> int | None:
        return None if pid in self.dead else 1

    def alive(self, pid: int, start_ticks: int | None) -> bool:
        return pid not in self.dead

    def kill(self, pid: int) -> None:
        self.killed.append(pid)
        self.dead.add(pid)

    def watch(self, pid: int) -> bool:
        if pid in self.dead:
            return False
        self.watched.add(pid)
        return True

    def unwatch(self, pid: int) -> None:
        self.watched.discard(pid)


def make_core(total_bytes: int = 8 * GIB, **kwargs):
    """A request core on a simulated device, with no sockets, files or processes of its own."""
    from kvcached_broker.broker.device import SimulatedDevice
    from kvcached_broker.broker.request_core import build_core

    processes = kwargs.pop("processes", None) or FakeProcesses()
    kwargs.setdefault("headroom", "0")
    return build_core(SimulatedDevice(0, total_bytes), processes, **kwargs)


def ledger_fingerprint(ledger) -> tuple:
    """Everything a refused request must leave as it was: totals, sessions' holdings, limits."""
    return (
        ledger.reserved_bytes, ledger.granted_bytes, ledger.unreported_bytes, dict(ledger.limits),
        {sid: (dict(s.pools), dict(s.holds), s.granted_pages, s.reserve_pages, s.state) for sid, s in ledger.sessions.items()},
    )
