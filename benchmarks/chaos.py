"""Chaos run: randomized kills, stops, restarts, evictions and limit changes against a real broker.

What it does
------------
It starts a real broker (``kvcached-broker serve --simulate SIZE --state-dir DIR``, as operators
run it) and a handful of real worker processes (``benchmarks/chaos_worker.py``), each holding one
``BrokerClient`` session: some with the default credit reserve and some with ``credit_pages=0``,
with mixed page sizes, some with ``reserve()`` pools.  The workers make random ``acquire`` (also
with ``min_pages``), ``release`` and ``reserve`` calls and keep their own books.  Meanwhile the run
draws N random events:

* ``kill_worker``: SIGKILL a worker, time how long until its session leaves status (reclaim
  latency), start a replacement;
* ``stop_worker``: SIGSTOP a worker (its books frozen first) for longer than the lease; before the
  SIGCONT its session must be ``stale`` and still charged exactly what the worker holds;
* ``restart_broker``: SIGKILL the broker and start it again on the same endpoint and state dir;
  ``restart_broker_in_burst`` does so in the middle of a burst of acquire/release traffic;
* ``evict``: evict a session through ``AdminClient`` (sometimes ``kill=True``); the worker must
  get ``SessionEvicted`` and exit, and is replaced;
* ``limit``: change an instance's ``max``/``min``/``weight``;
* ``traffic``: let the workers run for a moment;
* ``connection_flood``: open far more plain connections than the broker admits (it runs with
  ``max_connections`` a little above what the workers need) and hold them while the workers
  go on; the broker must refuse the excess, stay up, and admit connections again once they
  are closed;
* ``status_flood``: send 2,000 status requests on a connection that never reads; the broker
  must drop the replies past its bounds rather than keep them (its memory is checked);
* ``damaged_restart``: stop the broker (SIGKILL, or a clean stop for the snapshot's kinds),
  damage its state one way (a bit of the first journal record's length, a zero-filled journal,
  a bit of the snapshot, the snapshot, the journal or both deleted) and start it again: the
  damage must be reported with ``records_lost`` and growth held; meanwhile a resume with a
  made-up token (from the runner, a process older than the restart) must get no allowance, and
  a newcomer nothing; the workers whose records were lost re-assert, and the quiet point after
  must find every worker's books charged.  A session of the runner's own clients that the
  damaged state brings back (closed before the restart, its close lost with the records; its
  process, the runner, alive) stays charged until an operator evicts it: the runner does;
* ``in_doubt_orders``: a client of the runner's leaves a call in doubt while the broker is
  stopped (the request then lost with a SIGKILL, or applied after a SIGCONT), the broker is
  restarted, and the next call follows: every order of acquire, release and reserve in doubt,
  applied or not, then acquire, release, reserve or a heartbeat; after each, the broker must
  charge exactly the client's books (an order is skipped, and counted, if the client cannot get
  pages to release within the settle timeout: a full GPU, or growth held after damage);
* ``hello_limits``: as another user (uid 65534, when the run is root's), a hello under a
  worker's instance name asks for ``max_bytes: 0``, the whole budget as a floor and a weight of
  1e6 (once that worker's session is in the broker): the instance's limits must not change;
  a hello for an instance of the runner's own asks
  for the same and must be cut to the broker's bounds.

A thread samples status every 20 ms and checks its own invariants at each sample
(``budget = total - headroom - external``, ``free = max(0, budget - reserved - granted -
unreported)``, instance sums = device totals, session sums = instance totals, ``overcommitted``
iff charges exceed the budget, and never overcommitted on a simulated device with no external
usage).  Every few events, and at the end, comes a quiet point: each worker finishes its call in
flight and parks (acknowledged over its control pipe, never a fixed sleep), the run polls status
until every expected session is live and none is recovering, the workers freeze their books (the
client's lock held) and report them, and each worker's belief (``held_pages + reserve_pages``,
``pools``) is compared with what the broker charges its session (``granted_pages``, ``pools``).
Sessions whose process is gone (orphans) and sessions missing from status count as mismatches
too, and so does a worker whose own book disagrees with its client (a "book drift").

How to run it
-------------
::

    make chaos                                   # the default run: 1000 events
    .venv/bin/python benchmarks/chaos.py --quick # about 40 events, 3 workers
    .venv/bin/python benchmarks/chaos.py --events 300 --workers 4 --seed 7 --json chaos.json

It prints a table of figures and exits 0 when it found no mismatch, no invariant violation and no
failed check, 1 otherwise.  ``--keep`` keeps the work directory (broker and worker logs).
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import queue
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import msgspec
import zmq

from kvcached_broker.client import BrokerClient
from kvcached_broker.client.admin import AdminClient
from kvcached_broker.client.errors import BrokerError, BrokerUnavailable, BudgetExceeded
from kvcached_broker.client.transport import Timeouts
from kvcached_broker.client.units import format_bytes, parse_size
from kvcached_broker.tools.launch import BrokerLauncher

WORKER_SCRIPT = Path(__file__).with_name("chaos_worker.py")
INSTANCES = ("chaos-a", "chaos-b", "chaos-c")
PAGE_SIZES_BYTES = (256 << 10, 1 << 20, 2 << 20, 4 << 20)
MIB = 1 << 20

EVENT_WEIGHTS = {
    "traffic": 28,
    "kill_worker": 12,
    "stop_worker": 8,
    "restart_broker": 6,
    "restart_broker_in_burst": 6,
    "evict": 10,
    "limit": 30,
    "connection_flood": 3,
    "status_flood": 3,
    "damaged_restart": 4,
    "in_doubt_orders": 1,
    "hello_limits": 2,
}
#: How ``damaged_restart`` damages the state (issue 26, item 1).
DAMAGE_KINDS = ("journal_first_length_bit", "zero_filled_journal", "snapshot_bit", "deleted_snapshot",
                "deleted_journal", "deleted_snapshot_and_journal")
#: ``in_doubt_orders``: the call left in doubt, whether the broker applied it, and the next call.
IN_DOUBT_FIRST = ("acquire", "release", "reserve")
IN_DOUBT_NEXT = ("acquire", "release", "reserve", "heartbeat")
NOBODY_UID = 65534

SAMPLE_INTERVAL_S = 0.02
WORKER_REPLY_TIMEOUT_S = 120.0  # generous: a loaded 2-core machine, and nothing here depends on speed
SETTLE_TIMEOUT_S = 30.0
READY_TIMEOUT_S = 60.0
RECLAIM_TIMEOUT_S = 15.0
EVICT_NOTICE_TIMEOUT_S = 30.0
STOP_PAST_LEASE = 1.5  # a SIGSTOP lasts this many leases
EVICTED_EXIT_CODE = 17
MAX_EXAMPLES = 12
FLOOD_CONNECTIONS = 300
STATUS_FLOOD_REQUESTS = 2000
STATUS_FLOOD_GROWTH_BYTES = 64 << 20  # what 2,000 unread status replies may grow the broker by, at most

# The broker is started through this, so that it dies with the run even if the run is SIGKILLed:
# PR_SET_PDEATHSIG survives execve, and the broker process is then exactly `kvcached-broker serve`.
# (Children are started from the main thread only: the signal follows the thread that forked.)
_EXEC_WITH_PDEATHSIG = (
    "import ctypes,os,sys; ctypes.CDLL(None).prctl(1, 9); "
    "os.getppid() == int(sys.argv[1]) or os._exit(1); os.execv(sys.argv[2], sys.argv[2:])"
)
RUNNER_PID_ENV = "KVCACHED_CHAOS_RUNNER_PID"  # chaos_worker.py checks it is still the runner's child


# ============================================================================ figures
@dataclass
class Mismatch:
    """The broker's charge for one session against what its worker believes it holds."""

    kind: str  # charge | missing | orphan | book
    quiet_point: int
    diff_bytes: int  # broker minus worker; < 0 is an under-count
    session_id: str | None
    worker: dict[str, Any] = field(default_factory=dict)
    broker: dict[str, Any] = field(default_factory=dict)
    events_since_last_quiet: list[str] = field(default_factory=list)

    @property
    def sign(self) -> str:
        return "under" if self.diff_bytes < 0 else "over" if self.diff_bytes > 0 else "even"


@dataclass
class Figures:
    events: Counter = field(default_factory=Counter)
    skipped: Counter = field(default_factory=Counter)
    samples: int = 0
    samples_unavailable: int = 0
    violations: Counter = field(default_factory=Counter)
    violation_examples: list[str] = field(default_factory=list)
    quiet_points: int = 0
    quiet_timeouts: int = 0
    sessions_compared: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    book_drifts: list[Mismatch] = field(default_factory=list)
    broker_restarts: int = 0
    restarts_in_burst: int = 0
    ready_after_restart_s: list[float] = field(default_factory=list)
    resumed_after_restart_s: list[float] = field(default_factory=list)
    resume_timeouts: int = 0
    reclaim_s: list[float] = field(default_factory=list)
    reclaim_timeouts: int = 0
    stop_checks: int = 0
    stop_checks_restored: int = 0  # of which the broker restarted during the stop
    stop_failures: list[str] = field(default_factory=list)
    evictions: int = 0
    evictions_noticed: int = 0
    evict_failures: list[str] = field(default_factory=list)
    limits_applied: int = 0
    limits_refused: Counter = field(default_factory=Counter)
    flood_refused: int = 0  # connections the broker refused during connection floods
    status_flood_dropped: int = 0  # replies it dropped during status floods
    status_flood_growth_bytes: list[int] = field(default_factory=list)
    flood_failures: list[str] = field(default_factory=list)
    damaged_restarts: Counter = field(default_factory=Counter)  # by kind of damage
    damage_failures: list[str] = field(default_factory=list)
    forged_resumes_refused: int = 0
    newcomers_held: int = 0
    overcommitted_reasserting: int = 0  # samples over budget while lost records are re-asserted
    in_doubt_orders: int = 0
    in_doubt_failures: list[str] = field(default_factory=list)
    in_doubt_skipped: int = 0  # orders left out: no pages to release within SETTLE_TIMEOUT_S
    resurrected_evicted: int = 0  # the runner's closed sessions a damaged restart brought back
    hello_limit_checks: int = 0
    hello_limit_failures: list[str] = field(default_factory=list)
    worker_starts: int = 0
    worker_crashes: list[str] = field(default_factory=list)
    worker_unresponsive: list[str] = field(default_factory=list)
    broker_crashes: list[str] = field(default_factory=list)
    worker_calls: Counter = field(default_factory=Counter)
    worker_errors: Counter = field(default_factory=Counter)
    seconds_in: Counter = field(default_factory=Counter)
    elapsed_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def violation(self, kind: str, detail: str) -> None:
        with self.lock:
            self.violations[kind] += 1
            if len(self.violation_examples) < MAX_EXAMPLES:
                self.violation_examples.append(f"{kind}: {detail}")

    def failures(self) -> dict[str, int]:
        return {
            "mismatches": len(self.mismatches),
            "book_drifts": len(self.book_drifts),
            "status_violations": sum(self.violations.values()),
            "quiet_timeouts": self.quiet_timeouts,
            "reclaim_timeouts": self.reclaim_timeouts,
            "stop_failures": len(self.stop_failures),
            "evict_failures": len(self.evict_failures),
            "worker_crashes": len(self.worker_crashes),
            "worker_unresponsive": len(self.worker_unresponsive),
            "broker_crashes": len(self.broker_crashes),
            "flood_failures": len(self.flood_failures),
            "damage_failures": len(self.damage_failures),
            "in_doubt_failures": len(self.in_doubt_failures),
            "hello_limit_failures": len(self.hello_limit_failures),
        }

    def to_json(self, config: dict[str, Any]) -> dict[str, Any]:
        under = [m for m in self.mismatches if m.diff_bytes < 0]
        over = [m for m in self.mismatches if m.diff_bytes > 0]
        return {
            "config": config,
            "elapsed_s": round(self.elapsed_s, 3),
            "passed": not any(self.failures().values()),
            "failures": self.failures(),
            "events": dict(self.events),
            "events_total": sum(self.events.values()),
            "events_skipped": dict(self.skipped),
            "seconds_in": {k: round(v, 3) for k, v in self.seconds_in.items()},
            "status_samples": self.samples,
            "status_samples_unavailable": self.samples_unavailable,
            "status_violations": sum(self.violations.values()),
            "status_violations_by_kind": dict(self.violations),
            "status_violation_examples": self.violation_examples,
            "quiet_points": self.quiet_points,
            "quiet_timeouts": self.quiet_timeouts,
            "sessions_compared": self.sessions_compared,
            "mismatches": len(self.mismatches),
            "mismatches_by_kind": dict(Counter(m.kind for m in self.mismatches)),
            "mismatches_under": len(under),
            "mismatches_over": len(over),
            "worst_under_bytes": max((-m.diff_bytes for m in under), default=0),
            "worst_over_bytes": max((m.diff_bytes for m in over), default=0),
            "sessions_mismatched": len({m.session_id for m in self.mismatches}),
            "mismatch_examples": [asdict(m) | {"sign": m.sign} for m in _first_per_session(self.mismatches)],
            "book_drifts": len(self.book_drifts),
            "book_drift_examples": [asdict(m) for m in _first_per_session(self.book_drifts)],
            "broker_restarts": self.broker_restarts,
            "broker_restarts_in_burst": self.restarts_in_burst,
            "ready_after_restart_s_p50": _median(self.ready_after_restart_s),
            "ready_after_restart_s_max": max(self.ready_after_restart_s, default=None),
            "resumed_after_restart_s_p50": _median(self.resumed_after_restart_s),
            "resume_timeouts": self.resume_timeouts,
            "reclaim_ms_p50": _ms(_median(self.reclaim_s)),
            "reclaim_ms_max": _ms(max(self.reclaim_s, default=None)),
            "reclaims_timed": len(self.reclaim_s),
            "reclaim_timeouts": self.reclaim_timeouts,
            "stop_checks": self.stop_checks,
            "stop_checks_restored": self.stop_checks_restored,
            "stop_failures": self.stop_failures[:MAX_EXAMPLES],
            "evictions": self.evictions,
            "evictions_noticed": self.evictions_noticed,
            "evict_failures": self.evict_failures[:MAX_EXAMPLES],
            "limit_changes_applied": self.limits_applied,
            "limit_changes_refused": dict(self.limits_refused),
            "flood_connections_refused": self.flood_refused,
            "status_flood_replies_dropped": self.status_flood_dropped,
            "status_flood_growth_bytes_max": max(self.status_flood_growth_bytes, default=None),
            "flood_failures": self.flood_failures[:MAX_EXAMPLES],
            "damaged_restarts": dict(self.damaged_restarts),
            "damage_failures": self.damage_failures[:MAX_EXAMPLES],
            "forged_resumes_refused": self.forged_resumes_refused,
            "newcomers_held": self.newcomers_held,
            "status_samples_overcommitted_reasserting": self.overcommitted_reasserting,
            "in_doubt_orders": self.in_doubt_orders,
            "in_doubt_skipped": self.in_doubt_skipped,
            "resurrected_evicted": self.resurrected_evicted,
            "in_doubt_failures": self.in_doubt_failures[:MAX_EXAMPLES],
            "hello_limit_checks": self.hello_limit_checks,
            "hello_limit_failures": self.hello_limit_failures[:MAX_EXAMPLES],
            "worker_starts": self.worker_starts,
            "worker_crashes": self.worker_crashes[:MAX_EXAMPLES],
            "worker_unresponsive": self.worker_unresponsive[:MAX_EXAMPLES],
            "broker_crashes": self.broker_crashes[:MAX_EXAMPLES],
            "worker_calls": dict(self.worker_calls),
            "worker_errors": dict(self.worker_errors),
        }


def _first_per_session(records: list[Mismatch]) -> list[Mismatch]:
    """The first record of each session: one under-count usually stays until the session ends."""
    seen: dict[str | None, Mismatch] = {}
    for record in records:
        seen.setdefault(record.session_id, record)
    return list(seen.values())[:MAX_EXAMPLES]


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def _ms(value_s: float | None) -> float | None:
    return None if value_s is None else round(value_s * 1000.0, 2)


# ==================================================================== status checks
def status_violations(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """Status's own invariants, recomputed from the document alone."""
    found: list[tuple[str, str]] = []
    total, headroom, external = doc["total_bytes"], doc["headroom_bytes"], doc["external_bytes"]
    budget, free = doc["budget_bytes"], doc["free_bytes"]
    reserved, granted, unreported = doc["reserved_bytes"], doc["granted_bytes"], doc["unreported_bytes"]
    charges = reserved + granted + unreported
    if budget != total - headroom - external:
        found.append(("budget", f"budget {budget} != total {total} - headroom {headroom} - external {external}"))
    if free != max(0, budget - charges):
        found.append(("free_bytes", f"free {free} != max(0, budget {budget} - charges {charges})"))
    if bool(doc["overcommitted"]) != (charges > budget):
        found.append(("overcommitted", f"overcommitted={doc['overcommitted']} with charges {charges}, budget {budget}"))
    if charges > budget and external == 0 and unreported == 0 and not reasserting_lost_records(doc):
        found.append(("overbooked", f"charges {charges} exceed budget {budget} with no external usage"))
    found.extend(_instance_sum_violations(doc))
    for instance in doc["instances"]:
        found.extend(_session_sum_violations(instance))
    return found


def reasserting_lost_records(doc: dict[str, Any]) -> bool:
    """Growth held after damage that may have lost whole records: what the workers re-assert
    is charged whether or not it fits (restored records may over-charge until their own
    workers re-assert lower), so charges past the budget are honest then, not an overbooking."""
    broker = doc.get("broker", {})
    return bool(broker.get("growth_held") and (broker.get("state_damage") or {}).get("records_lost"))


def _instance_sum_violations(doc: dict[str, Any]) -> list[tuple[str, str]]:
    found = []
    for key in ("reserved_bytes", "granted_bytes", "unreported_bytes"):
        summed = sum(i[key] for i in doc["instances"])
        if summed != doc[key]:
            found.append(("instance_sums", f"sum of instances' {key} {summed} != device {doc[key]}"))
    return found


def _session_sum_violations(instance: dict[str, Any]) -> list[tuple[str, str]]:
    found = []
    name, sessions = instance["name"], instance["sessions"]
    for key in ("reserved_bytes", "granted_bytes"):
        summed = sum(s[key] for s in sessions)
        if summed != instance[key]:
            found.append(("session_sums", f"{name}: sum of sessions' {key} {summed} != instance {instance[key]}"))
    pools: Counter = Counter()
    for s in sessions:
        pools.update(s["pools"])
        if s["granted_bytes"] != s["granted_pages"] * s["page_bytes"]:
            found.append(("session_pages", f"{s['id']}: granted_bytes != granted_pages * page_bytes"))
        if s["reserved_bytes"] != sum(s["pools"].values()):
            found.append(("session_pools", f"{s['id']}: reserved_bytes != sum of its pools"))
    if {k: v for k, v in pools.items() if v} != {k: v for k, v in instance["pools"].items() if v}:
        found.append(("pool_sums", f"{name}: instance pools {instance['pools']} != sum of sessions' {dict(pools)}"))
    return found


def sessions_by_id(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["id"]: {**s, "instance": i["name"]} for i in doc["instances"] for s in i["sessions"]}


class StatusSampler(threading.Thread):
    """Polls status every ``interval_s`` and checks :func:`status_violations` on each sample."""

    def __init__(self, endpoint: str, figures: Figures, interval_s: float = SAMPLE_INTERVAL_S):
        super().__init__(name="chaos-status-sampler", daemon=True)
        self.endpoint = endpoint
        self.figures = figures
        self.interval_s = interval_s
        self._halt = threading.Event()
        self._admin: AdminClient | None = None

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)

    def run(self) -> None:
        while not self._halt.wait(self.interval_s):
            doc = self._sample()
            if doc is None:
                self.figures.samples_unavailable += 1
                continue
            self.figures.samples += 1
            if doc["overcommitted"] and reasserting_lost_records(doc):
                self.figures.overcommitted_reasserting += 1
            for kind, detail in status_violations(doc):
                self.figures.violation(kind, detail)
        if self._admin is not None:
            self._admin.close()

    def _sample(self) -> dict[str, Any] | None:
        try:
            if self._admin is None:
                self._admin = AdminClient(self.endpoint, timeout_s=0.5)
            return self._admin.status()
        except BrokerError:
            if self._admin is not None:
                self._admin.close()
            self._admin = None
            return None


# ==================================================================== the processes
class BrokerProc:
    """The broker subprocess: SIGKILL and restart keep the endpoint and the state directory."""

    def __init__(self, workdir: Path, simulate: str, lease_s: float, max_connections: int):
        self.log_path = workdir / "broker.log"
        self.max_connections = max_connections
        self.state_dir = workdir / "state"
        # Run as root, the socket is open to NOBODY_UID's group too (the hello_limits event
        # speaks as another user); its directory is the broker's own.
        self.other_user_group = _nobody_group() if os.getuid() == 0 else None
        group_args = ["--socket-group", self.other_user_group] if self.other_user_group else []
        if self.other_user_group:
            os.chmod(workdir, 0o755)
        self.launcher = BrokerLauncher(
            f"ipc://{workdir}/run/gpu0.sock", simulate=simulate, state_dir=self.state_dir,
            args=["--lease", str(lease_s), "--log-level", "info", *group_args], log=self.log_path,
            prefix=[sys.executable, "-c", _EXEC_WITH_PDEATHSIG, str(os.getpid())], new_session=True,
            extra_env={"KVCACHED_BROKER_MAX_CONNECTIONS": str(max_connections)},
        )
        self.endpoint = self.launcher.endpoint

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.launcher.proc

    def start(self) -> float:
        """Start it and return the seconds until its status answers."""
        started_s = time.monotonic()
        self.launcher.start(timeout_s=READY_TIMEOUT_S)
        return time.monotonic() - started_s

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.launcher.stop(sig)

    def send(self, sig: int) -> None:
        """A signal without waiting (SIGSTOP, SIGCONT)."""
        self.launcher.send(sig)

    def log(self) -> str:
        return self.launcher.log()

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.launcher.log().splitlines()[-lines:])


@dataclass
class StopRecord:
    books: dict[str, Any]
    charged_bytes: int  # what the broker charged the session when it was stopped
    due_s: float
    restarts_at_stop: int


class WorkerProc:
    """One chaos_worker.py process and the JSON-lines channel to it."""

    def __init__(self, slot: int, generation: int, config: dict[str, Any], workdir: Path):
        self.slot = slot
        self.generation = generation
        self.config = config
        self.log_path = workdir / f"worker-{slot}-{generation}.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(WORKER_SCRIPT), json.dumps(config)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1,
                start_new_session=True, env={**os.environ, RUNNER_PID_ENV: str(os.getpid())},
            )
        self.pid = self.proc.pid
        self.inbox: queue.Queue = queue.Queue()
        self.session_id: str | None = None
        self.ready = False
        self.gone = False  # its stdout ended
        self.expect_exit = False
        self.stop: StopRecord | None = None
        self.last_books: dict[str, Any] = {}
        self.errors: list[str] = []
        self._seq = 0
        threading.Thread(target=self._read, name=f"chaos-reader-{slot}", daemon=True).start()

    @property
    def name(self) -> str:
        return f"w{self.slot}.{self.generation}"

    def describe(self) -> dict[str, Any]:
        c = self.config
        return {"worker": self.name, "pid": self.pid, "instance": c["instance"], "page_bytes": c["page_bytes"],
                "credit_pages": c["credit_pages"], "pools": c["pools"]}

    def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                try:
                    self.inbox.put(json.loads(line))
                except ValueError:
                    self.inbox.put({"ev": "garbage", "line": line[:200]})
        except (OSError, ValueError):
            pass  # closed under us at the end of the run
        self.inbox.put({"ev": "eof"})

    def _absorb(self, message: dict[str, Any]) -> None:
        ev = message.get("ev")
        if ev == "ready":
            self.ready = True
            self.session_id = message["session_id"]
        elif ev == "eof":
            self.gone = True
        elif ev in ("error", "garbage"):
            self.errors.append(json.dumps(message)[:2000])

    def drain(self) -> None:
        while True:
            try:
                self._absorb(self.inbox.get_nowait())
            except queue.Empty:
                return

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> bool:
        deadline_s = time.monotonic() + timeout_s
        while not self.ready and not self.gone:
            remaining_s = deadline_s - time.monotonic()
            if remaining_s <= 0:
                return False
            try:
                self._absorb(self.inbox.get(timeout=remaining_s))
            except queue.Empty:
                return False
        return self.ready and not self.gone

    def send(self, op: str, **fields: Any) -> int | None:
        """Write one command; returns its sequence number, or None if the worker is gone."""
        self._seq += 1
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": op, "seq": self._seq, **fields}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            return None
        return self._seq

    def reply(self, seq: int | None, timeout_s: float = WORKER_REPLY_TIMEOUT_S) -> dict[str, Any] | None:
        if seq is None:
            return None
        deadline_s = time.monotonic() + timeout_s
        while not self.gone:
            remaining_s = deadline_s - time.monotonic()
            if remaining_s <= 0:
                return None
            try:
                message = self.inbox.get(timeout=remaining_s)
            except queue.Empty:
                return None
            if message.get("seq") == seq:
                if message.get("session_id"):
                    self.session_id = message["session_id"]  # a session lost to damage is a new one
                return message
            self._absorb(message)
        return None

    def request(self, op: str, timeout_s: float = WORKER_REPLY_TIMEOUT_S, **fields: Any) -> dict[str, Any] | None:
        return self.reply(self.send(op, **fields), timeout_s)

    def signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def wait_exit(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # stdout ends by itself: the reader thread sees EOF
        except OSError:
            pass

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        except OSError:
            return ""


def request_all(workers: Iterable[WorkerProc], op: str, **fields: Any) -> dict[WorkerProc, dict[str, Any] | None]:
    """Send ``op`` to every worker first, then collect the answers (they work in parallel)."""
    sent = [(w, w.send(op, **fields)) for w in workers]
    return {w: w.reply(seq) for w, seq in sent}


# ======================================================================== the run
@dataclass
class RunConfig:
    events: int
    workers: int
    seed: int
    simulate: str
    lease_s: float
    quiet_every: int
    keep: bool = False
    verbose: bool = False


class ChaosRun:
    def __init__(self, config: RunConfig):
        self.config = config
        self.rng = random.Random(config.seed)
        self.workdir = Path(tempfile.mkdtemp(prefix="kbc-", dir="/tmp"))
        self.total_bytes = parse_size(config.simulate)
        # Room for every worker's connection several times over (replacements, resumes), the
        # sampler and the admin client; a connection flood goes far past it.
        self.broker = BrokerProc(self.workdir, config.simulate, config.lease_s, 8 * config.workers + 64)
        self.figures = Figures()
        self.sampler = StatusSampler(self.broker.endpoint, self.figures)
        self.workers: dict[int, WorkerProc] = {}
        self.retired_books: list[dict[str, Any]] = []
        self.generations: Counter = Counter()
        self.recent_events: list[str] = []
        self._admin: AdminClient | None = None
        self._closed = False

    # ---------------------------------------------------------------- plumbing
    def admin(self) -> AdminClient:
        if self._admin is None:
            self._admin = AdminClient(self.broker.endpoint, timeout_s=10.0)
        return self._admin

    def reset_admin(self) -> None:
        if self._admin is not None:
            self._admin.close()
        self._admin = None

    def status(self) -> dict[str, Any]:
        """Status from the broker; a broker that died on its own is a failure, and is restarted."""
        for _ in range(3):
            try:
                return self.admin().status()
            except BrokerUnavailable:
                self.reset_admin()
                if self.broker.proc is not None and self.broker.proc.poll() is not None:
                    self.figures.broker_crashes.append(f"rc={self.broker.proc.returncode}: {self.broker.log_tail(10)}")
                    self.note(f"broker died on its own (rc={self.broker.proc.returncode}); restarting it")
                    self.broker.start()
        return self.admin().status()

    def note(self, text: str) -> None:
        line = f"{time.monotonic() - self.started_s:8.3f}s {text}"
        self.recent_events.append(line)
        if self.config.verbose:
            print(line, file=sys.stderr, flush=True)

    def worker_config(self, slot: int) -> dict[str, Any]:
        page_bytes = self.rng.choice(PAGE_SIZES_BYTES)
        return {
            "endpoint": self.broker.endpoint,
            "instance": INSTANCES[slot % len(INSTANCES)],
            "page_bytes": page_bytes,
            "credit_pages": None if (slot + self.generations[slot]) % 2 == 0 else 0,
            "pools": slot == 0 or self.rng.random() < 0.5,
            "pool_max_bytes": int(self.total_bytes * 0.04) // MIB * MIB,
            "max_pages": max(8, int(self.total_bytes * 0.3) // page_bytes),
            "seed": self.rng.randrange(1 << 30),
            "timeout_s": 60.0,
        }

    def spawn(self, slot: int) -> WorkerProc:
        self.generations[slot] += 1
        worker = WorkerProc(slot, self.generations[slot], self.worker_config(slot), self.workdir)
        self.workers[slot] = worker
        self.figures.worker_starts += 1
        return worker

    def retire(self, worker: WorkerProc) -> None:
        worker.kill()
        if worker.last_books:
            self.retired_books.append(worker.last_books)
        if self.workers.get(worker.slot) is worker:
            del self.workers[worker.slot]

    def replace(self, worker: WorkerProc) -> WorkerProc:
        self.retire(worker)
        return self.spawn(worker.slot)

    def ask(self, worker: WorkerProc, op: str, **fields: Any) -> dict[str, Any] | None:
        return self.ask_all([worker], op, **fields)[worker]

    def ask_all(self, workers: Iterable[WorkerProc], op: str, **fields: Any) -> dict[WorkerProc, dict[str, Any] | None]:
        """:func:`request_all`, and a worker alive but silent past the timeout is a failure."""
        replies = request_all(workers, op, **fields)
        for worker, reply in replies.items():
            if reply is None and not worker.gone and worker.proc.poll() is None:
                self.figures.worker_unresponsive.append(f"{worker.name} pid {worker.pid}: no answer to {op!r}")
                self.note(f"{worker.name} did not answer {op!r}")
        return replies

    def live_workers(self) -> list[WorkerProc]:
        return [w for w in self.workers.values() if w.ready and not w.gone and w.stop is None]

    def reap_exits(self) -> None:
        """A worker that exited on its own (not killed, not evicted by us) is a crash."""
        for worker in list(self.workers.values()):
            worker.drain()
            rc = worker.proc.poll()
            if rc is None and not worker.gone:
                continue
            if rc is None:
                rc = worker.wait_exit(10)
            detail = f"{worker.name} pid {worker.pid} exited rc={rc}: {' | '.join(worker.errors)[:1500]} {worker.log_tail()}"
            self.figures.worker_crashes.append(detail)
            self.note(f"crash {worker.name} rc={rc}")
            self.replace(worker)

    # ---------------------------------------------------------------- the run
    def run(self) -> Figures:
        self.started_s = time.monotonic()
        try:
            self.broker.start()
            for slot in range(self.config.workers):
                self.spawn(slot)
            self.wait_all_ready()
            self.sampler.start()
            for index, kind in enumerate(self.schedule()):
                self.reap_exits()
                self.service_stopped(force=False)
                self.dispatch(kind)
                if (index + 1) % self.config.quiet_every == 0 or index + 1 == self.config.events:
                    self.quiet_point()
        finally:
            self.figures.elapsed_s = time.monotonic() - self.started_s
            self.close()
        return self.figures

    def schedule(self) -> list[str]:
        """Every kind once first (in a random order), then random draws by weight."""
        kinds = list(EVENT_WEIGHTS)
        self.rng.shuffle(kinds)
        names, weights = zip(*EVENT_WEIGHTS.items())
        while len(kinds) < self.config.events:
            kinds.append(self.rng.choices(names, weights)[0])
        return kinds[: self.config.events]

    def dispatch(self, kind: str) -> None:
        handlers: dict[str, Callable[[], bool]] = {
            "traffic": self.ev_traffic,
            "kill_worker": self.ev_kill_worker,
            "stop_worker": self.ev_stop_worker,
            "restart_broker": lambda: self.ev_restart_broker(burst=False),
            "restart_broker_in_burst": lambda: self.ev_restart_broker(burst=True),
            "evict": self.ev_evict,
            "limit": self.ev_limit,
            "connection_flood": self.ev_connection_flood,
            "status_flood": self.ev_status_flood,
            "damaged_restart": self.ev_damaged_restart,
            "in_doubt_orders": self.ev_in_doubt_orders,
            "hello_limits": self.ev_hello_limits,
        }
        began_s = time.monotonic()
        if handlers[kind]():
            self.figures.events[kind] += 1
        else:
            self.figures.skipped[kind] += 1
        self.figures.seconds_in[kind] += time.monotonic() - began_s

    def wait_all_ready(self) -> None:
        for worker in list(self.workers.values()):
            if not worker.wait_ready():
                self.reap_exits()

    def pick(self, candidates: list[WorkerProc]) -> WorkerProc | None:
        return self.rng.choice(candidates) if candidates else None

    # ---------------------------------------------------------------- events
    def ev_traffic(self) -> bool:
        time.sleep(self.rng.uniform(0.02, 0.15))  # chaos timing: let the workers run, not a sync
        return True

    def ev_kill_worker(self) -> bool:
        candidates = [w for w in self.workers.values() if w.ready and not w.gone]
        worker = self.pick(candidates)
        if worker is None:
            return False
        session_id = worker.session_id
        self.note(f"SIGKILL {worker.name} session {session_id}{' (stopped)' if worker.stop else ''}")
        killed_s = time.monotonic()
        worker.signal(signal.SIGKILL)
        reclaim_s = self.wait_session_gone(session_id, killed_s)
        if reclaim_s is None:
            self.figures.reclaim_timeouts += 1
            self.note(f"reclaim timeout {session_id}")
        else:
            self.figures.reclaim_s.append(reclaim_s)
        worker.expect_exit = True
        self.replace(worker)
        return True

    def wait_session_gone(self, session_id: str | None, since_s: float) -> float | None:
        deadline_s = since_s + RECLAIM_TIMEOUT_S
        while time.monotonic() < deadline_s:
            if session_id not in sessions_by_id(self.status()):
                return time.monotonic() - since_s
        return None

    def ev_stop_worker(self) -> bool:
        worker = self.pick(self.live_workers())
        if worker is None:
            return False
        if not self.ask(worker, "pause") or not self.wait_settled([worker], whole=False):
            self.ask(worker, "resume")
            return False
        books = self.ask(worker, "snapshot")
        session = sessions_by_id(self.status()).get(worker.session_id)
        if not books or not books.get("ok") or session is None:
            self.ask(worker, "resume")
            return False
        worker.last_books = books
        worker.signal(signal.SIGSTOP)
        due_s = time.monotonic() + STOP_PAST_LEASE * self.config.lease_s
        worker.stop = StopRecord(books, session_bytes(session), due_s, self.figures.broker_restarts)
        self.note(f"SIGSTOP {worker.name} session {worker.session_id} holding {_book_text(books)}")
        return True

    def service_stopped(self, force: bool) -> None:
        """SIGCONT every stopped worker whose time is up (all of them with ``force``), after checking it."""
        for worker in list(self.workers.values()):
            if worker.stop is None:
                continue
            if not force and time.monotonic() < worker.stop.due_s:
                continue
            time.sleep(max(0.0, worker.stop.due_s - time.monotonic()))  # the stop must outlast the lease
            self.check_stopped(worker)
            worker.signal(signal.SIGCONT)
            worker.stop = None
            self.note(f"SIGCONT {worker.name}")
            if not self.ask(worker, "resume"):
                self.reap_exits()

    def check_stopped(self, worker: WorkerProc) -> None:
        """A stopped worker's session must turn stale and stay charged what it was charged when
        stopped; restored by a broker restarted meanwhile, it turns stale a lease after the restart."""
        assert worker.stop is not None
        self.figures.stop_checks += 1
        deadline_s = time.monotonic() + 4 * self.config.lease_s + 10
        session = None
        while time.monotonic() < deadline_s:
            session = sessions_by_id(self.status()).get(worker.session_id)
            if session is None or session["state"] == "stale":
                break
            time.sleep(SAMPLE_INTERVAL_S)
        stop = worker.stop
        label = f"{worker.name} session {worker.session_id}"
        if session is None:
            self.figures.stop_failures.append(f"{label}: stopped, and its session left status")
            return
        if session["state"] != "stale":
            self.figures.stop_failures.append(f"{label}: stopped past the lease, still {session['state']}")
            return
        diff_bytes = session_bytes(session) - stop.charged_bytes
        restarted = self.figures.broker_restarts != stop.restarts_at_stop
        self.figures.stop_checks_restored += int(restarted)
        # A broker restarted meanwhile keeps it at its checkpoint (recovering, then stale once
        # silent for the lease), which may over-charge (a deferred release) but never under-charge.
        tolerated = restarted and session["state"] in ("recovering", "stale") and diff_bytes > 0
        if diff_bytes and not tolerated:
            self.figures.stop_failures.append(
                f"{label}: stopped, its charge moved by {diff_bytes:+d} bytes (state {session['state']}, "
                f"worker {_book_text(stop.books)}, broker now {_session_text(session)})"
            )

    def ev_restart_broker(self, burst: bool) -> bool:
        if burst:
            self.ask_all(self.live_workers(), "burst", ms=400)
            time.sleep(self.rng.uniform(0.005, 0.08))  # chaos timing: land inside the burst
        self.note(f"broker SIGKILL{' in a burst' if burst else ''}")
        self.broker.kill()
        self.reset_admin()
        ready_s = self.broker.start()
        restarted_s = time.monotonic()
        self.figures.broker_restarts += 1
        self.figures.restarts_in_burst += int(burst)
        self.figures.ready_after_restart_s.append(ready_s)
        self.note(f"broker ready after {ready_s:.3f}s")
        if self.wait_recovered():
            self.figures.resumed_after_restart_s.append(time.monotonic() - restarted_s)
        else:
            self.figures.resume_timeouts += 1
        return True

    def wait_recovered(self, ignore: frozenset[str | None] = frozenset()) -> bool:
        """Until no session but a stopped worker's (or one in ``ignore``) is recovering."""
        deadline_s = time.monotonic() + SETTLE_TIMEOUT_S
        while time.monotonic() < deadline_s:
            stopped = {w.session_id for w in self.workers.values() if w.stop is not None} | ignore
            recovering = {sid for sid, s in sessions_by_id(self.status()).items() if s["state"] == "recovering"}
            if recovering <= stopped:
                return True
            time.sleep(SAMPLE_INTERVAL_S)
        return False

    def limits(self) -> dict[str, Any]:
        return self.status()["broker"]["limits"]

    def ev_connection_flood(self) -> bool:
        """Past ``max_connections``: the excess refused, the broker up, admission back afterwards."""
        path = str(self.broker.endpoint)[len("ipc://"):]
        refused_before = sum(self.limits()["connections"]["refused"].values())
        socks: list[socket.socket] = []
        try:
            for _ in range(FLOOD_CONNECTIONS):
                sock = socket.socket(socket.AF_UNIX)
                try:
                    sock.connect(path)
                except OSError:
                    sock.close()
                    break
                socks.append(sock)
            self.note(f"connection flood: {len(socks)} plain connections held")
            refused = self.wait_for(lambda: sum(self.limits()["connections"]["refused"].values()) - refused_before)
        finally:
            for sock in socks:
                sock.close()
        if not refused:
            self.figures.flood_failures.append(f"{len(socks)} connections, none refused: {self.limits()['connections']}")
            return True
        self.figures.flood_refused += refused
        bound = self.broker.max_connections
        if not self.wait_for(lambda: self.limits()["connections"]["admitted"] < bound):
            self.figures.flood_failures.append(f"admission did not come back: {self.limits()['connections']}")
        return True

    def ev_status_flood(self) -> bool:
        """Status asked and never read: replies past the bounds dropped, the broker's memory flat."""
        proc = self.broker.proc
        if proc is None or proc.poll() is not None:
            return False
        counters = self.status()["broker"]["counters"]
        asked, dropped_before = counters["requests"], sum(self.limits()["replies"]["dropped"].values())
        rss_before = _rss_bytes(proc.pid)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.RCVBUF, 4096)
        sock.connect(self.broker.endpoint)
        try:
            for request_id in range(STATUS_FLOOD_REQUESTS):
                sock.send(msgspec.msgpack.encode({"op": "status", "id": request_id}))
            answered = self.wait_for(
                lambda: self.status()["broker"]["counters"]["requests"] >= asked + STATUS_FLOOD_REQUESTS)
            growth_bytes = _rss_bytes(proc.pid) - rss_before
        finally:
            sock.close(0)
        dropped = sum(self.limits()["replies"]["dropped"].values()) - dropped_before
        self.note(f"status flood: {dropped} replies dropped, the broker grew {growth_bytes >> 10} KiB")
        self.figures.status_flood_dropped += dropped
        self.figures.status_flood_growth_bytes.append(growth_bytes)
        if not answered or growth_bytes > STATUS_FLOOD_GROWTH_BYTES or not dropped:
            self.figures.flood_failures.append(
                f"status flood: answered={bool(answered)} growth={growth_bytes} bytes, dropped={dropped}")
        return True

    # ------------------------------------------------ damage, forged resumes (issue 26, items 1 and 3)
    def ev_damaged_restart(self) -> bool:
        """The broker stopped, its state damaged one way, started again: damage reported with
        ``records_lost`` and growth held; a made-up resume and a newcomer get nothing meanwhile;
        the workers re-assert (the quiet point then compares their books)."""
        self.service_stopped(force=True)  # a stopped worker's check expects its session to stay
        kind = self.rng.choice(DAMAGE_KINDS)
        clean = kind in ("snapshot_bit", "deleted_snapshot")  # the sessions in the snapshot alone
        self.note(f"broker {'stopped' if clean else 'SIGKILL'} to damage its state: {kind}")
        self.broker.kill(signal.SIGTERM if clean else signal.SIGKILL)
        self.reset_admin()
        kind = damage_state(self.broker.state_dir, kind)
        ready_s = self.broker.start()
        restarted_s = time.monotonic()
        self.figures.broker_restarts += 1
        self.figures.ready_after_restart_s.append(ready_s)
        self.figures.damaged_restarts[kind] += 1
        doc = self.status()
        self.evict_resurrected(kind, doc)
        broker = doc["broker"]
        damage = broker.get("state_damage") or {}
        if not (damage.get("records_lost") and broker.get("growth_held")):
            self.figures.damage_failures.append(f"{kind}: not held as damage that lost records: {damage}, "
                                                f"growth_held={broker.get('growth_held')!r}")
        self.check_forged_resume(kind)
        self.check_newcomer_held(kind)
        if self.wait_recovered():
            self.figures.resumed_after_restart_s.append(time.monotonic() - restarted_s)
        else:
            self.figures.resume_timeouts += 1
        return True

    def held(self) -> bool:
        return bool(self.status()["broker"].get("growth_held"))

    def evict_resurrected(self, kind: str, doc: dict[str, Any]) -> None:
        """Sessions of the runner's own clients, restored by a damaged restart: each was closed
        before it (the runner closes its clients within their event), its close lost with the
        damaged records; its process being alive, the broker keeps charging it until an operator
        evicts it (docs/reliability.md), which the runner does here, as an operator would."""
        for session_id, session in sessions_by_id(doc).items():
            if session["pid"] != os.getpid():
                continue
            try:
                self.admin().evict(session_id, kill=False)
            except BrokerError as exc:
                self.figures.damage_failures.append(f"{kind}: evicting the runner's restored {session_id}: {exc}")
                continue
            self.figures.resurrected_evicted += 1
            self.note(f"{kind}: the runner's closed session {session_id} came back; evicted")

    def check_forged_resume(self, kind: str) -> None:
        """A resume with a made-up token, claiming much, from the runner (a process older than
        the restart), while growth is held: its session gets no allowance, and no page."""
        if not self.held():
            return
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        sock.connect(self.broker.endpoint)
        try:
            forged = "".join(self.rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdef0123456789") for _ in range(32))
            hello = {"op": "hello", "id": 1, "versions": [1], "instance": "chaos-forger", "pid": os.getpid(),
                     "page_bytes": MIB, "nonce": f"forger-{self.rng.randrange(1 << 40)}", "resume": forged,
                     "holdings": {"pools": {}, "granted_pages": self.total_bytes // MIB, "reserve_pages": 0}}
            sock.send(msgspec.msgpack.encode(hello))
            opened = msgspec.msgpack.decode(sock.recv())
            if not opened.get("ok"):
                self.figures.damage_failures.append(f"{kind}: forged resume hello refused: {opened}")
                return
            token = opened["result"]["session"]
            sock.send(msgspec.msgpack.encode({"op": "acquire", "id": 2, "session": token, "pages": 64, "min_pages": 1}))
            got = msgspec.msgpack.decode(sock.recv())["result"]
            sock.send(msgspec.msgpack.encode({"op": "close", "id": 3, "session": token}))
            sock.recv()
        except zmq.Again:
            self.figures.damage_failures.append(f"{kind}: no answer to the forged resume")
            return
        finally:
            sock.close(0)
        if got["granted"]:
            self.figures.damage_failures.append(f"{kind}: a forged resume was granted {got['granted']} page(s)")
        else:
            self.figures.forged_resumes_refused += 1
            self.note(f"forged resume refused: {got.get('refused', {}).get('code')}")

    def check_newcomer_held(self, kind: str) -> None:
        """A process with no record asks for a page while the workers re-assert: nothing."""
        held_before = self.held()
        try:
            with BrokerClient.connect("chaos-newcomer", endpoint=self.broker.endpoint, page_bytes=MIB,
                                      credit_pages=0, background=False, timeout_s=30.0) as newcomer:
                granted = newcomer.acquire(1)
        except BrokerError as exc:
            self.figures.damage_failures.append(f"{kind}: the newcomer could not ask: {exc}")
            return
        if held_before and self.held():
            if granted:
                self.figures.damage_failures.append(f"{kind}: a newcomer was granted a page while growth was held")
            else:
                self.figures.newcomers_held += 1

    # ------------------------------------------------------ every order in doubt (issue 26, item 2)
    def ev_in_doubt_orders(self) -> bool:
        """A client of the runner's leaves a call in doubt across a restart, then calls again;
        the first time every order, later a random third of them."""
        self.service_stopped(force=True)
        orders = [(first, applied, then) for first in IN_DOUBT_FIRST for applied in (False, True)
                  for then in IN_DOUBT_NEXT]
        if self.figures.in_doubt_orders:
            orders = self.rng.sample(orders, len(orders) // 3)
        try:
            client = BrokerClient.connect("chaos-doubt", endpoint=self.broker.endpoint, page_bytes=MIB,
                                          credit_pages=0, background=False, timeout_s=30.0)
        except BrokerError as exc:
            self.figures.in_doubt_failures.append(f"connect: {exc}")
            return True
        try:
            for first, applied, then in orders:
                self.in_doubt_order(client, first, applied, then)
        finally:
            try:
                client.close()
            except BrokerError:
                pass
        return True

    def in_doubt_order(self, client: BrokerClient, first: str, applied: bool, then: str) -> None:
        label = f"{first} in doubt ({'applied' if applied else 'lost'}), broker restarted, then {then}"
        try:
            # Pages for a release in doubt and one after it (2 each): on a full GPU, or while
            # growth is held after a damaged restart, the top-up is refused until room comes back.
            if not self.wait_for(lambda: client.held_pages >= 4 or (client.acquire(8) > 0 and client.held_pages >= 4)):
                self.figures.in_doubt_skipped += 1
                self.note(f"{label}: skipped, the client could not get pages to release")
                return
            call = self._doubt_call(client, first)
            before = self._charged(client)
            self.broker.send(signal.SIGSTOP)
            _set_timeout(client, 0.3)
            try:
                call()
                self.figures.in_doubt_failures.append(f"{label}: the call was answered by a stopped broker")
            except BrokerUnavailable:
                pass  # in doubt
            except BaseException:
                self.broker.send(signal.SIGCONT)  # recorded below; the broker is not left stopped for the run
                raise
            finally:
                _set_timeout(client, 30.0)
            if applied:
                self.broker.send(signal.SIGCONT)
                if not self.wait_for(lambda: self._charged(client) != before):
                    self.note(f"{label}: the broker did not apply it after SIGCONT")
            self.broker.kill()
            self.reset_admin()
            self.broker.start()
            self.figures.broker_restarts += 1
            if not self.wait_recovered(frozenset({client.session_id})):  # the workers resume before the next restart
                self.figures.resume_timeouts += 1
            try:
                self._doubt_call(client, then)()
            except BudgetExceeded:
                pass  # no room: refused, and so booked as nothing
            client.heartbeat()
        except BrokerError as exc:
            self.figures.in_doubt_failures.append(f"{label}: {exc}")
            return
        self.figures.in_doubt_orders += 1
        session = sessions_by_id(self.status()).get(client.session_id)
        books = (client.held_pages + client.reserve_pages - client.uncharged_pages,
                 {k: v for k, v in client.pools.items() if v})
        charged = None if session is None else (session["granted_pages"], book_pools(session))
        if charged != books or client.uncharged_pages:
            self.figures.in_doubt_failures.append(
                f"{label}: the broker charges {charged}, the books say {books} (uncharged {client.uncharged_pages})")
            self.note(f"IN DOUBT MISMATCH {label}")

    def _doubt_call(self, client: BrokerClient, name: str) -> Callable[[], Any]:
        if name == "acquire":
            return lambda: client.acquire(3)
        if name == "release":
            return lambda: client.release(2)
        if name == "reserve":
            size = self.rng.randint(1, 32) * MIB
            return lambda: client.reserve({"weights": size})
        return client.heartbeat

    def _charged(self, client: BrokerClient) -> tuple[int, dict[str, int]] | None:
        try:
            session = sessions_by_id(self.status()).get(client.session_id)
        except BrokerError:
            return None
        return None if session is None else (session["granted_pages"], book_pools(session))

    # --------------------------------------------------- limits a hello asks for (issue 26, item 5)
    def ev_hello_limits(self) -> bool:
        """As another user, a hello under a worker's instance asks for crippling limits: the
        instance's limits must not move.  The runner's own instance asks for a floor of the
        whole budget and a weight of 1e6: cut to the broker's bounds."""
        if self.broker.other_user_group is None:
            return False  # not root: no other user to speak as
        worker = self.pick(self.live_workers())
        if worker is None:
            return False
        instance = worker.config["instance"]
        budget = self.status()["budget_bytes"]
        greedy = {"max_bytes": 0, "min_bytes": budget, "weight": 1e6}
        # The worker's session must be in the broker first: one lost to damaged state is opened
        # again at its client's next call, and until then the instance is the other uid's to ask
        # for; the worker coming back meanwhile read as the other uid's hello moving the limits.
        before = self.wait_for(lambda: self.instance_limits(instance))
        if not before:
            return False
        script = (
            "import os, sys;"
            "from kvcached_broker.client import BrokerClient;"
            f"os.setgid({NOBODY_UID}); os.setuid({NOBODY_UID});"
            f"c = BrokerClient.connect({instance!r}, endpoint={self.broker.endpoint!r}, page_bytes={MIB},"
            f" credit_pages=0, background=False, timeout_s=30.0, limits={greedy!r});"
            "c.close()"
        )
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        self.figures.hello_limit_checks += 1
        after = self.instance_limits(instance)
        if out.returncode != 0:
            self.figures.hello_limit_failures.append(f"uid {NOBODY_UID} on {instance}: {out.stderr[-500:]}")
        elif after != before:
            self.figures.hello_limit_failures.append(
                f"uid {NOBODY_UID}'s hello moved {instance}'s limits from {before} to {after}")
        else:
            self.note(f"uid {NOBODY_UID}'s hello limits on {instance}: refused")
        bounds = self.status()["broker"]["hello_limits"]
        with BrokerClient.connect("chaos-own-limits", endpoint=self.broker.endpoint, page_bytes=MIB,
                                  credit_pages=0, background=False, timeout_s=30.0,
                                  limits={"min_bytes": budget, "weight": 1e6}) as own:
            mine = self.instance_limits("chaos-own-limits")
            own.close()
        self.figures.hello_limit_checks += 1
        if mine["min_bytes"] > budget * bounds["max_floor_share"] or mine["weight"] > bounds["max_weight"]:
            self.figures.hello_limit_failures.append(f"a hello's own limits past the bounds {bounds}: {mine}")
        return True

    def instance_limits(self, instance: str) -> dict[str, Any]:
        for entry in self.status()["instances"]:
            if entry["name"] == instance:
                return {key: entry[key] for key in ("max_bytes", "min_bytes", "weight")}
        return {}

    def wait_for(self, predicate: Callable[[], Any]) -> Any:
        """``predicate()`` once it is truthy, polling status's pace; its last value after SETTLE_TIMEOUT_S."""
        deadline_s = time.monotonic() + SETTLE_TIMEOUT_S
        value = predicate()
        while not value and time.monotonic() < deadline_s:
            time.sleep(SAMPLE_INTERVAL_S)
            value = predicate()
        return value

    def ev_evict(self) -> bool:
        worker = self.pick(self.live_workers())
        if worker is None:
            return False
        kill = self.rng.random() < 0.25
        try:
            result = self.admin().evict(worker.session_id, kill=kill)
        except BrokerError as exc:
            self.note(f"evict {worker.session_id} refused: {exc.code}")
            return False
        self.figures.evictions += 1
        self.note(f"evict{' --kill' if kill else ''} {worker.name} session {worker.session_id} freed {result.freed_bytes}")
        if worker.session_id in sessions_by_id(self.status()):
            self.figures.evict_failures.append(f"{worker.name}: session {worker.session_id} still in status after evict")
        rc = worker.wait_exit(EVICT_NOTICE_TIMEOUT_S)
        expected_rc = -signal.SIGKILL if kill else EVICTED_EXIT_CODE
        if rc == expected_rc:
            self.figures.evictions_noticed += 1
        else:
            self.figures.evict_failures.append(f"{worker.name}: after evict (kill={kill}) rc={rc}, expected {expected_rc}")
        worker.expect_exit = True
        self.replace(worker)
        return True

    def ev_limit(self) -> bool:
        instance = self.rng.choice(INSTANCES)
        change = self.limit_change()
        try:
            self.admin().limit(instance, **change)
        except BrokerError as exc:
            self.figures.limits_refused[exc.code] += 1
            self.note(f"limit {instance} {change} refused: {exc.code}")
            return True
        self.figures.limits_applied += 1
        self.note(f"limit {instance} {change}")
        return True

    def limit_change(self) -> dict[str, Any]:
        budget_bytes = int(self.total_bytes * 0.95)
        change: dict[str, Any] = {}
        for key in self.rng.sample(["max_bytes", "min_bytes", "weight"], self.rng.randint(1, 2)):
            if key == "max_bytes":
                change[key] = None if self.rng.random() < 0.35 else int(budget_bytes * self.rng.uniform(0.15, 0.9)) // MIB * MIB
            elif key == "min_bytes":
                change[key] = 0 if self.rng.random() < 0.4 else int(budget_bytes * self.rng.uniform(0.0, 0.2)) // MIB * MIB
            else:
                change[key] = self.rng.choice([0.5, 1.0, 2.0, 3.0])
        return change

    # ---------------------------------------------------------------- quiet points
    def quiet_point(self) -> None:
        self.service_stopped(force=True)
        self.reap_exits()
        self.wait_all_ready()
        self.reap_exits()
        began_s = time.monotonic()
        self.figures.quiet_points += 1
        index = self.figures.quiet_points
        workers = self.live_workers()
        paused = self.ask_all(workers, "pause")
        workers = [w for w in workers if paused[w] and paused[w].get("ok")]
        if not self.wait_settled(workers, whole=True):
            self.figures.quiet_timeouts += 1
            self.note("quiet point: status did not settle")
        books = self.ask_all(workers, "snapshot")
        doc = self.status()
        self.compare(index, doc, {w: b for w, b in books.items() if b and b.get("ok")})
        self.ask_all(workers, "resume")
        self.reap_exits()
        self.recent_events = []
        self.figures.seconds_in["quiet_point"] += time.monotonic() - began_s

    def wait_settled(self, workers: list[WorkerProc], whole: bool) -> bool:
        """Until every (paused) worker's session is live, and (``whole``) nothing recovers and no
        orphan remains.  A worker whose session was lost to damage opens a new one when its
        client next speaks (a heartbeat), so the ids are asked for again now and then."""
        deadline_s = time.monotonic() + SETTLE_TIMEOUT_S
        refresh_s = time.monotonic() + 1.0
        while time.monotonic() < deadline_s:
            sessions = sessions_by_id(self.status())
            ok = all(sessions.get(w.session_id, {}).get("state") == "live" for w in workers)
            if ok and whole:
                known_pids = {w.pid for w in self.workers.values()}
                ok = all(s["state"] != "recovering" and s["pid"] in known_pids for s in sessions.values())
            if ok:
                return True
            if time.monotonic() >= refresh_s:
                self.ask_all(workers, "pause")  # parked already: it answers with its session id now
                refresh_s = time.monotonic() + 1.0
            time.sleep(SAMPLE_INTERVAL_S)
        return False

    def compare(self, index: int, doc: dict[str, Any], books: dict[WorkerProc, dict[str, Any]]) -> None:
        sessions = sessions_by_id(doc)
        for worker, book in books.items():
            worker.last_books = book
            self.figures.sessions_compared += 1
            self.check_book_drift(index, worker, book)
            session = sessions.get(book["session_id"])
            if session is None:
                self.mismatch("missing", index, -worker_bytes(book), book["session_id"], worker, book, {})
                continue
            diff_bytes = charge_diff_bytes(book, session)
            if diff_bytes or book_pools(book) != book_pools(session) or worker_pages(book) != session["granted_pages"]:
                self.mismatch("charge", index, diff_bytes, session["id"], worker, book, session)
        known_pids = {w.pid for w in self.workers.values()}
        for session in sessions.values():
            if session["pid"] not in known_pids:
                self.mismatch("orphan", index, session_bytes(session), session["id"], None, {}, session)

    def check_book_drift(self, index: int, worker: WorkerProc, book: dict[str, Any]) -> None:
        drift_pages = book["held_pages"] - book["book_held_pages"]
        drift_pool_bytes = sum(book_pools(book).values()) - sum(book["book_pools"].values())
        if drift_pages or book_pools(book) != book["book_pools"]:
            record = Mismatch(
                "book", index, drift_pages * book["page_bytes"] + drift_pool_bytes, book["session_id"],
                worker.describe() | _book_summary(book), {}, list(self.recent_events),
            )
            self.figures.book_drifts.append(record)

    def mismatch(self, kind: str, index: int, diff_bytes: int, session_id: str | None, worker: WorkerProc | None,
                 book: dict[str, Any], session: dict[str, Any]) -> None:
        record = Mismatch(
            kind, index, diff_bytes, session_id,
            (worker.describe() | _book_summary(book)) if worker else {},
            _session_summary(session) if session else {},
            list(self.recent_events),
        )
        self.figures.mismatches.append(record)
        self.note(f"MISMATCH {kind} {session_id} {diff_bytes:+d} bytes")

    # ---------------------------------------------------------------- the end
    def close(self) -> None:
        """Stop every process this run started; safe to call twice, and from atexit."""
        if self._closed:
            return
        self._closed = True
        steps: list[Callable[[], None]] = [self.sampler.stop] if self.sampler.is_alive() else []
        steps += [lambda w=w: (w.signal(signal.SIGCONT), self.retire(w)) for w in list(self.workers.values())]
        steps += [self.gather_worker_counters, self.reset_admin, lambda: self.broker.kill(signal.SIGTERM)]
        try:
            for step in steps:
                try:
                    step()
                except Exception as exc:  # noqa: BLE001 - keep going: the other processes must go too
                    print(f"cleanup: {exc!r}", file=sys.stderr)
        finally:
            self.broker.kill()
            if self.config.keep:
                print(f"work directory kept: {self.workdir}", file=sys.stderr)
            else:
                shutil.rmtree(self.workdir, ignore_errors=True)

    def gather_worker_counters(self) -> None:
        for book in self.retired_books:
            self.figures.worker_calls.update(book.get("calls", {}))
            self.figures.worker_errors.update(book.get("errors", {}))
        self.retired_books = []


# ======================================================================== book arithmetic
def book_pools(doc: dict[str, Any]) -> dict[str, int]:
    return {k: v for k, v in doc.get("pools", {}).items() if v}


def worker_pages(book: dict[str, Any]) -> int:
    return book["held_pages"] + book["reserve_pages"]


def worker_bytes(book: dict[str, Any]) -> int:
    return worker_pages(book) * book["page_bytes"] + sum(book_pools(book).values())


def session_bytes(session: dict[str, Any]) -> int:
    return session["granted_pages"] * session["page_bytes"] + sum(book_pools(session).values())


def charge_diff_bytes(book: dict[str, Any], session: dict[str, Any]) -> int:
    """What the broker charges minus what the worker believes it holds (< 0: under-count)."""
    return session_bytes(session) - worker_bytes(book)


def _book_summary(book: dict[str, Any]) -> dict[str, Any]:
    keys = ("held_pages", "reserve_pages", "pools", "book_held_pages", "book_pools", "errors", "last_errors")
    return {k: book[k] for k in keys if k in book}


def _session_summary(session: dict[str, Any]) -> dict[str, Any]:
    keys = ("id", "instance", "pid", "state", "page_bytes", "granted_pages", "reserve_pages", "pools")
    return {k: session[k] for k in keys if k in session}


def _book_text(book: dict[str, Any]) -> str:
    return f"held {book['held_pages']} + reserve {book['reserve_pages']} pages of {book['page_bytes']} B, pools {book_pools(book)}"


def _session_text(session: dict[str, Any]) -> str:
    return f"granted {session['granted_pages']} pages (reserve {session['reserve_pages']}), pools {book_pools(session)}"


def damage_state(state_dir: Path, kind: str) -> str:
    """Damage the state of a broker that is down, one of ``DAMAGE_KINDS``; returns the kind
    done (a journal with nothing to damage is deleted instead)."""
    journal, snapshot = state_dir / "gpu0.journal", state_dir / "gpu0.snapshot"
    if kind in ("journal_first_length_bit", "zero_filled_journal"):
        data = journal.read_bytes() if journal.exists() else b""
        if len(data) < 8:
            kind = "deleted_journal"
        elif kind == "journal_first_length_bit":
            journal.write_bytes(bytes([data[0] ^ 0x01]) + data[1:])
        else:
            journal.write_bytes(bytes(len(data)))
    if kind == "snapshot_bit":
        data = bytearray(snapshot.read_bytes())
        data[len(data) - 5] ^= 0x01
        snapshot.write_bytes(bytes(data))
    elif kind.startswith("deleted_"):
        for name in kind.removeprefix("deleted_").split("_and_"):
            (state_dir / f"gpu0.{name}").unlink(missing_ok=True)
    return kind


def _set_timeout(client: BrokerClient, total_s: float) -> None:
    """Another request timeout for a connected client (a private attribute, on purpose: the
    harness makes a call time out only while the broker is stopped)."""
    client._transport.timeouts = Timeouts.from_env(total_s)


def _nobody_group() -> str | None:
    import grp

    try:
        return grp.getgrgid(NOBODY_UID).gr_name
    except KeyError:
        return None


def _rss_bytes(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ======================================================================== the report
def render(report: dict[str, Any]) -> str:
    cfg = report["config"]
    rows: list[tuple[str, Any]] = [
        (f"events ({cfg['events']} drawn)", report["events_total"]),
        *((f"  {kind}", count) for kind, count in sorted(report["events"].items())),
        ("  skipped (no candidate)", sum(report["events_skipped"].values())),
        ("status samples", report["status_samples"]),
        ("  while the broker was down", report["status_samples_unavailable"]),
        ("status invariant violations", report["status_violations"]),
        *((f"  {kind}", n) for kind, n in sorted(report["status_violations_by_kind"].items())),
        ("quiet points", report["quiet_points"]),
        ("  that did not settle", report["quiet_timeouts"]),
        ("sessions compared", report["sessions_compared"]),
        ("MISMATCHES", report["mismatches"]),
        ("  sessions with a mismatch", report["sessions_mismatched"]),
        *((f"  {kind}", n) for kind, n in sorted(report["mismatches_by_kind"].items())),
        ("  under-counts (broker < worker)", report["mismatches_under"]),
        ("  over-counts (broker > worker)", report["mismatches_over"]),
        ("  worst under-count", format_bytes(report["worst_under_bytes"])),
        ("  worst over-count", format_bytes(report["worst_over_bytes"])),
        ("book drifts (worker book != client)", report["book_drifts"]),
        ("broker restarts", f"{report['broker_restarts']} ({report['broker_restarts_in_burst']} in a burst)"),
        ("  broker deaths not caused by the run", len(report["broker_crashes"])),
        ("  ready after restart, p50", _seconds(report["ready_after_restart_s_p50"])),
        ("  ready after restart, max", _seconds(report["ready_after_restart_s_max"])),
        ("  all sessions resumed, p50", _seconds(report["resumed_after_restart_s_p50"])),
        ("  resume timeouts", report["resume_timeouts"]),
        ("reclaim after SIGKILL, p50", _millis(report["reclaim_ms_p50"])),
        ("reclaim after SIGKILL, max", _millis(report["reclaim_ms_max"])),
        ("  reclaims timed / timed out", f"{report['reclaims_timed']} / {report['reclaim_timeouts']}"),
        ("stops past the lease checked", report["stop_checks"]),
        ("  across a broker restart (restored, then stale)", report["stop_checks_restored"]),
        ("  failed (not stale or not charged)", len(report["stop_failures"])),
        ("evictions noticed", f"{report['evictions_noticed']} / {report['evictions']}"),
        ("limit changes applied", report["limit_changes_applied"]),
        ("limit changes refused", sum(report["limit_changes_refused"].values())),
        ("connections refused in floods", report["flood_connections_refused"]),
        ("status replies dropped in floods", report["status_flood_replies_dropped"]),
        ("  broker growth per status flood, max", None if report["status_flood_growth_bytes_max"] is None
         else format_bytes(report["status_flood_growth_bytes_max"])),
        ("  flood checks failed", len(report["flood_failures"])),
        ("damaged restarts", sum(report["damaged_restarts"].values())),
        *((f"  {kind}", n) for kind, n in sorted(report["damaged_restarts"].items())),
        ("  forged resumes refused", report["forged_resumes_refused"]),
        ("  the runner's closed sessions brought back, evicted", report["resurrected_evicted"]),
        ("  newcomers held while workers re-asserted", report["newcomers_held"]),
        ("  samples over budget while re-asserting", report["status_samples_overcommitted_reasserting"]),
        ("  damage checks failed", len(report["damage_failures"])),
        ("orders in doubt across a restart checked", report["in_doubt_orders"]),
        ("  skipped (no pages to release)", report["in_doubt_skipped"]),
        ("  failed (charge != books)", len(report["in_doubt_failures"])),
        ("hello limits checked (another uid, bounds)", report["hello_limit_checks"]),
        ("  failed", len(report["hello_limit_failures"])),
        ("worker starts", report["worker_starts"]),
        ("worker crashes", len(report["worker_crashes"])),
        ("workers that stopped answering", len(report["worker_unresponsive"])),
        ("worker calls", sum(v for k, v in report["worker_calls"].items() if not k.endswith("_refused"))),
        ("  refused (no room, cap, floor)", sum(v for k, v in report["worker_calls"].items() if k.endswith("_refused"))),
        ("  errors", sum(report["worker_errors"].values())),
        ("elapsed", _seconds(report["elapsed_s"])),
    ]
    width = max(len(name) for name, _ in rows)
    head = (f"chaos run: seed {cfg['seed']}, {cfg['workers']} workers, lease {cfg['lease_s']} s, "
            f"simulated {cfg['simulate']}, quiet point every {cfg['quiet_every']} events")
    lines = [head, "-" * len(head)]
    lines += [f"{name:<{width}}  {value if value is not None else '-'}" for name, value in rows]
    lines += _render_problems(report)
    failed = {k: v for k, v in report["failures"].items() if v}
    lines.append("")
    lines.append("result: PASS" if not failed else "result: FAIL (" + ", ".join(f"{k}={v}" for k, v in failed.items()) + ")")
    return "\n".join(lines)


def _render_problems(report: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for m in report["mismatch_examples"]:
        lines += ["", f"mismatch at quiet point {m['quiet_point']}: {m['kind']} {m['sign']} {m['diff_bytes']:+d} bytes, "
                      f"session {m['session_id']}",
                  f"  worker: {json.dumps(m['worker'], sort_keys=True)}",
                  f"  broker: {json.dumps(m['broker'], sort_keys=True)}",
                  "  events since the previous quiet point:"]
        lines += [f"    {e}" for e in m["events_since_last_quiet"][-12:]]
    for m in report["book_drift_examples"][:3]:
        lines += ["", f"book drift at quiet point {m['quiet_point']}: {json.dumps(m['worker'], sort_keys=True)}"]
    for title, key in (("status violation", "status_violation_examples"), ("stop check failed", "stop_failures"),
                       ("evict check failed", "evict_failures"), ("worker crash", "worker_crashes"),
                       ("worker unresponsive", "worker_unresponsive"), ("broker crash", "broker_crashes"),
                       ("flood check failed", "flood_failures"), ("damage check failed", "damage_failures"),
                       ("in-doubt order failed", "in_doubt_failures"), ("hello limits check failed", "hello_limit_failures")):
        lines += [f"{title}: {text}" for text in report[key][:5]]
    if report["worker_errors"]:
        lines.append(f"worker errors: {json.dumps(report['worker_errors'], sort_keys=True)}")
    return lines


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def _millis(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


# ======================================================================== main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=None, help="random events to draw (default 1000; 40 with --quick)")
    parser.add_argument("--workers", type=int, default=None, help="worker processes (default 5; 3 with --quick)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: drawn and printed)")
    parser.add_argument("--quick", action="store_true", help="a short run: 40 events, 3 workers, a quiet point every 5")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--simulate", default="3GiB", metavar="SIZE", help="simulated GPU size (default 3GiB)")
    parser.add_argument("--lease", type=float, default=2.5, metavar="S", help="broker lease in seconds (default 2.5)")
    parser.add_argument("--quiet-every", type=int, default=None, help="events between quiet points (default 10; 5 with --quick)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs) under /tmp")
    parser.add_argument("--verbose", action="store_true", help="print every event as it happens (stderr)")
    args = parser.parse_args(argv)
    args.events = args.events if args.events is not None else (40 if args.quick else 1000)
    args.workers = args.workers if args.workers is not None else (3 if args.quick else 5)
    args.quiet_every = args.quiet_every if args.quiet_every is not None else (5 if args.quick else 10)
    args.seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    if args.events < 1 or args.workers < 1 or args.quiet_every < 1 or args.lease <= 0:
        parser.error("--events, --workers and --quiet-every must be positive, and so must --lease")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The runner's own clients (a newcomer, a client left in doubt, a hello asking for limits)
    # warn as a worker's would; the run judges what they got, and prints its figures alone.
    logging.getLogger("kvcached_broker").addHandler(logging.NullHandler())
    config = RunConfig(args.events, args.workers, args.seed, args.simulate, args.lease, args.quiet_every, args.keep, args.verbose)
    print(f"chaos run: {config.events} events, {config.workers} workers, seed {config.seed} ...", flush=True)
    run = ChaosRun(config)
    atexit.register(run.close)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        figures = run.run()
    except KeyboardInterrupt:
        print("interrupted; processes cleaned up", file=sys.stderr)
        return 130
    report = figures.to_json(asdict(config))
    print(render(report), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
