"""One worker of the chaos run (``benchmarks/chaos.py``): a ``BrokerClient`` session under random traffic.

The runner starts it as::

    python benchmarks/chaos_worker.py '{"endpoint": "ipc:///tmp/kbc-x/gpu0.sock", "instance": "chaos-a",
                                        "page_bytes": 2097152, "credit_pages": null, "pools": true,
                                        "max_pages": 256, "seed": 7, "timeout_s": 60}'

It connects, prints ``{"ev": "ready", ...}`` and then drives random traffic from a thread:
``acquire(n)``, ``acquire(n, min_pages=m)``, ``release(k)`` and, when ``pools`` is set, an occasional
``reserve({...})``.  It keeps its own book of what it was granted (``book_held_pages``: the sum of
what ``acquire`` returned minus what ``release`` gave back without an error; ``book_pools``: what the
last successful ``reserve`` returned), next to what the client itself believes
(``held_pages``, ``reserve_pages``, ``pools``).

Control channel: one JSON object per line on stdin, each answered by one JSON line on stdout that
echoes its ``seq``:

* ``{"op": "pause"}``: the traffic thread finishes its call in flight and parks; answered once it is
  parked (the client's background thread still heartbeats and resumes a restarted broker);
* ``{"op": "snapshot"}``: takes the client's lock as well, so that its background thread (refills,
  pressure answers, heartbeats) stands still too, and answers with the books; they cannot change
  until ``resume``;
* ``{"op": "resume"}``: lets go of the lock and restarts the traffic;
* ``{"op": "burst", "ms": N}``: N milliseconds of traffic with no pauses between calls (the runner
  kills the broker in the middle of one);
* ``{"op": "quit"}``: closes the session and exits 0.

Unsolicited lines: ``{"ev": "evicted"}`` (then exit 17) and ``{"ev": "error", ...}``.  End of stdin
(the runner died) exits at once, and so does the death of the runner (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
RUNNER_PID_ENV = "KVCACHED_CHAOS_RUNNER_PID"


def die_with_parent() -> None:
    """Die with the runner, even if it is SIGKILLed: first thing, before the slow imports."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the end of stdin still ends the worker
    runner_pid = os.environ.get(RUNNER_PID_ENV)
    if runner_pid and os.getppid() != int(runner_pid):
        os._exit(1)  # the runner died before the line above took effect


if __name__ == "__main__":
    die_with_parent()

import json  # noqa: E402
import random  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

from kvcached_broker.client import BrokerClient  # noqa: E402
from kvcached_broker.client.errors import BrokerError, BrokerUnavailable, BudgetExceeded, SessionEvicted  # noqa: E402

EVICTED_EXIT_CODE = 17
CONNECT_FAILED_EXIT_CODE = 3
NORMAL_GAP_S = 0.004  # at most this long between two calls outside a burst
PARK_TIMEOUT_S = 120.0
POOL_NAMES = ("swa_kv_pool", "c4_kv_pool", "c128_kv_pool")

_print_lock = threading.Lock()


def emit(message: dict[str, Any]) -> None:
    """One JSON line to the runner; whole lines only, whichever thread speaks."""
    line = json.dumps(message, sort_keys=True)
    with _print_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


@dataclass
class Book:
    """What this worker knows it was granted, kept apart from the client's own counters."""

    held_pages: int = 0
    pools: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    last_errors: list[str] = field(default_factory=list)

    def count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def error(self, op: str, exc: BaseException) -> None:
        code = getattr(exc, "code", type(exc).__name__)
        key = f"{op}:{code}"
        self.errors[key] = self.errors.get(key, 0) + 1
        self.last_errors = (self.last_errors + [f"{key}: {exc}"])[-5:]


class Traffic:
    """The thread that calls the broker; ``pause`` parks it between two calls."""

    def __init__(self, client: BrokerClient, config: dict[str, Any], book: Book):
        self.client = client
        self.book = book
        self.rng = random.Random(config["seed"])
        self.max_pages = int(config["max_pages"])
        self.chunk_pages = max(4, self.max_pages // 24)  # the most one acquire asks for
        self.pools_enabled = bool(config["pools"])
        self.pool_max_bytes = int(config.get("pool_max_bytes", 256 << 20))
        self._cond = threading.Condition()
        self._paused = False
        self._parked = False
        self._burst_until_s = 0.0

    # ---------------------------------------------------------- control side
    def pause(self, timeout_s: float = PARK_TIMEOUT_S) -> bool:
        with self._cond:
            self._paused = True
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._parked, timeout=timeout_s)

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def burst(self, duration_s: float) -> None:
        with self._cond:
            self._burst_until_s = time.monotonic() + duration_s

    # ---------------------------------------------------------- traffic side
    def run(self) -> None:
        while True:
            self._park_if_paused()
            self._step()
            if time.monotonic() >= self._burst_until_s:
                time.sleep(self.rng.uniform(0.0, NORMAL_GAP_S))

    def _park_if_paused(self) -> None:
        with self._cond:
            if not self._paused:
                return
            self._parked = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: not self._paused)
            self._parked = False

    def _step(self) -> None:
        # Never release more than the client says it holds either: once the two disagree (a
        # quiet point reports that drift), the traffic stays meaningful.
        held_pages = min(self.book.held_pages, self.client.held_pages)
        roll = self.rng.random()
        try:
            if self.pools_enabled and roll < 0.03:
                self._reserve()
            elif held_pages == 0 or (roll < 0.6 and held_pages < self.max_pages):
                self._acquire(held_pages)
            else:
                self._release(held_pages)
        except SessionEvicted:
            emit({"ev": "evicted", "pid": os.getpid()})
            os._exit(EVICTED_EXIT_CODE)

    def _acquire(self, held_pages: int) -> None:
        room_pages = max(1, self.max_pages - held_pages)
        pages = self.rng.randint(1, min(self.chunk_pages, room_pages))
        min_pages = self.rng.randint(0, pages) if self.rng.random() < 0.4 else None
        op = "acquire_min" if min_pages is not None else "acquire"
        self.book.count(op)
        try:
            granted_pages = self.client.acquire(pages, min_pages=min_pages)
        except (BrokerUnavailable, BrokerError) as exc:
            if isinstance(exc, SessionEvicted):
                raise
            self.book.error(op, exc)
            return
        if granted_pages == 0:
            self.book.count(f"{op}_refused")
        self.book.held_pages += granted_pages

    def _release(self, held_pages: int) -> None:
        if self.rng.random() < 0.9:
            pages = self.rng.randint(1, min(held_pages, max(1, self.chunk_pages // 2)))
        else:
            pages = self.rng.randint(1, held_pages)
        self.book.count("release")
        try:
            self.client.release(pages)
        except (BrokerUnavailable, BrokerError) as exc:
            if isinstance(exc, SessionEvicted):
                raise
            self.book.error("release", exc)  # the caller was told it failed: the book keeps the pages
            return
        self.book.held_pages -= pages

    def _reserve(self) -> None:
        names = self.rng.sample(POOL_NAMES, self.rng.randint(1, len(POOL_NAMES)))
        step_bytes = 1 << 20
        pools = {name: self.rng.randint(0, self.pool_max_bytes // step_bytes) * step_bytes for name in names}
        self.book.count("reserve")
        try:
            self.book.pools = dict(self.client.reserve(pools))
        except BudgetExceeded:
            self.book.count("reserve_refused")
        except (BrokerUnavailable, BrokerError) as exc:
            if isinstance(exc, SessionEvicted):
                raise
            self.book.error("reserve", exc)


class Control:
    """The stdin side: pause, snapshot (the client's lock held), resume, burst, quit."""

    def __init__(self, client: BrokerClient, traffic: Traffic, book: Book, config: dict[str, Any]):
        self.client = client
        self.traffic = traffic
        self.book = book
        self.config = config
        self._lock_held = False

    def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        op = command.get("op")
        reply: dict[str, Any] = {"seq": command.get("seq"), "op": op, "session_id": self.client.session_id}
        if op == "pause":
            reply["ok"] = self.traffic.pause()
        elif op == "snapshot":
            reply["ok"] = self._freeze()
            reply.update(self.books())
        elif op == "resume":
            self._thaw()
            self.traffic.resume()
            reply["ok"] = True
        elif op == "burst":
            self.traffic.burst(float(command.get("ms", 100)) / 1000.0)
            reply["ok"] = True
        elif op == "quit":
            self._thaw()
            self.client.close()
            emit({**reply, "ok": True})
            os._exit(0)
        else:
            reply["ok"] = False
            reply["error"] = f"unknown op {op!r}"
        return reply

    def _freeze(self) -> bool:
        """Hold the client's lock: its background thread can neither refill nor heartbeat now."""
        if not self._lock_held:
            # A private attribute on purpose: the harness needs books that cannot move while it
            # reads the broker's side.  Both client threads take this lock around every call.
            self._lock_held = self.client._lock.acquire(timeout=PARK_TIMEOUT_S)
        return self._lock_held

    def _thaw(self) -> None:
        if self._lock_held:
            self.client._lock.release()
            self._lock_held = False

    def books(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "instance": self.config["instance"],
            "page_bytes": self.client.page_bytes,
            "held_pages": self.client.held_pages,
            "reserve_pages": self.client.reserve_pages,
            "pools": self.client.pools,
            "book_held_pages": self.book.held_pages,
            "book_pools": {k: v for k, v in self.book.pools.items() if v},
            "calls": dict(self.book.calls),
            "errors": dict(self.book.errors),
            "last_errors": list(self.book.last_errors),
        }

    def serve(self) -> None:
        for line in sys.stdin:
            line = line.strip()
            if line:
                emit(self.handle(json.loads(line)))
        os._exit(0)  # the runner went away


def connect(config: dict[str, Any]) -> BrokerClient:
    deadline_s = time.monotonic() + float(config.get("timeout_s", 60))
    while True:
        try:
            return BrokerClient.connect(
                config["instance"],
                endpoint=config["endpoint"],
                page_bytes=int(config["page_bytes"]),
                credit_pages=config["credit_pages"],
                timeout_s=float(config.get("timeout_s", 60)),
            )
        except BrokerError as exc:
            if not exc.retryable or time.monotonic() > deadline_s:
                raise
            time.sleep(0.1)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the runner cleans up; Ctrl-C is its business
    config = json.loads(argv[1])
    try:
        client = connect(config)
    except BrokerError as exc:
        emit({"ev": "error", "where": "connect", "error": str(exc)})
        return CONNECT_FAILED_EXIT_CODE
    book = Book()
    traffic = Traffic(client, config, book)
    control = Control(client, traffic, book, config)
    emit({"ev": "ready", "session_id": client.session_id, "pid": os.getpid(), "page_bytes": client.page_bytes})

    def run_traffic() -> None:
        try:
            traffic.run()
        except BaseException:  # noqa: BLE001 - any failure of the traffic is reported, then the worker exits
            emit({"ev": "error", "where": "traffic", "error": traceback.format_exc()})
            os._exit(1)

    threading.Thread(target=run_traffic, name="chaos-traffic", daemon=True).start()
    control.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
