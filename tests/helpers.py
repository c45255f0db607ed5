"""Constants and small helpers shared by the tests (import as ``from helpers import ...``)."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

GIB = 1 << 30
MIB = 1 << 20


def wait_for(predicate, timeout_s: float = 60.0, interval_s: float = 0.01, what: str = "condition",
             explain=None):
    """Poll ``predicate`` until it returns a truthy value; fail the test after ``timeout_s``.

    The timeout only bounds a failure (generous, so a loaded machine does not fail the suite);
    the test goes on as soon as the condition holds.  ``explain()``, if given, is called on a
    timeout and its value shown with the failure (the state the condition was read from)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    shown = f"; state: {explain()!r}" if explain is not None else ""
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last value: {last!r}){shown}")


def python_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("KVCACHED_BROKER", None)
    return env


def connect_to(endpoint: str, credit_pages: int | None = 0):
    """A ``sessions.set_client_factory`` factory that opens adapter sessions on ``endpoint`` (adapter tests).

    It opens them as the adapter does (``sessions.connect``: the adapter identity included),
    only with the endpoint fixed.
    """
    import dataclasses

    from kvcached_broker.adapters import sessions

    def factory(identity):
        return sessions.connect(dataclasses.replace(identity, credit_pages=credit_pages), endpoint=endpoint)

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
        from kvcached_broker.adapters import support

        assert want in support.runtime(dist).tested(), f"overlay {expected} is not in adapters/support.py"
    elif found is None or not expected:
        pytest.skip(f"{dist} adapter tests run inside an overlay (make test-adapters)")
    return found


def require_kvcached_mode(dist: str, label: str) -> str:
    """:func:`require_runtime` for a kvcached+RUNTIME overlay, with kvcached at the version
    ``KVCACHED_BROKER_TEST_KVCACHED`` names (a missing one fails inside the overlay; outside
    it, no kvcached skips).  ``label`` names the runtime in the skip message."""
    from importlib.metadata import PackageNotFoundError, version

    import pytest

    found = require_runtime(dist)
    expected = os.environ.get("KVCACHED_BROKER_TEST_KVCACHED", "")
    try:
        kvcached = version("kvcached")
    except PackageNotFoundError:
        kvcached = None
    if expected:
        assert kvcached == expected.split("-", 1)[1], f"overlay expects {expected}, found kvcached {kvcached}"
    elif kvcached is None:
        pytest.skip(f"kvcached mode for {label} runs in the kvcached+{dist} overlay (make test-adapters)")
    return found


def device_and_status(usage_dir: Path, admin) -> tuple[dict[int, int], dict]:
    """The shared device's bytes by pid and the broker's status, read together under the
    device's allocation lock: nobody maps or unmaps between the two readings."""
    from kvcached_broker.broker.device import read_shared_usage
    from kvcached_broker.tools.shared_gpu import allocation_lock

    usage_dir.mkdir(parents=True, exist_ok=True)
    with allocation_lock(usage_dir):
        return read_shared_usage(usage_dir), admin.status()


def granted_bytes_by_pid(status: dict) -> dict[int, int]:
    """Bytes of pages the broker granted, per process holding a session."""
    granted: dict[int, int] = {}
    for instance in status["instances"]:
        for session in instance["sessions"]:
            pid = session["pid"]
            granted[pid] = granted.get(pid, 0) + session["granted_pages"] * session["page_bytes"]
    return granted


class FakeProcesses:
    """``ProcessOps`` for driving the request core without processes: every pid is alive unless
    listed in ``dead``, and started at tick 1 unless ``ticks`` says otherwise (the core reads
    its own pid's first: a later tick is a process started after the broker); kills and
    watches are recorded."""

    def __init__(self) -> None:
        self.dead: set[int] = set()
        self.ticks: dict[int, int] = {}
        self.killed: list[int] = []
        self.watched: set[int] = set()

    def start_ticks(self, pid: int) -> int | None:
        return None if pid in self.dead else self.ticks.get(pid, 1)

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


def restarted_core(state_dir: Path, total_bytes: int = 8 * GIB, now: float = 0.0, **kwargs):
    """A request core with a journal in ``state_dir``, restored from it as the server starts one
    (``Journal.restore``, the sessions whose processes live, then ``Journal.started``)."""
    core = make_core(total_bytes, state_dir=state_dir, **kwargs)
    core.restore(core.journal.restore(), now)
    core.journal.started()
    return core


def local_peer(pid: int | None = None, uid: int | None = None, gid: int | None = None):
    """A local connection's kernel credentials, as the broker reads them off an ipc socket."""
    from kvcached_broker.broker.security import Peer

    pid = os.getpid() if pid is None else pid
    uid = os.getuid() if uid is None else uid
    gid = os.getgid() if gid is None else gid
    return Peer(uid, gid, pid, f"localhost:{uid}:{gid}:{pid}")


_connections = itertools.count(1)


class CoreConnection:
    """One connection of ``peer`` (this process by default) to a request core, with its own
    routing id: plain MessagePack maps (or exact frames) in, decoded replies out, as
    ``raw_ask`` does over a socket.  ``now`` is the clock value the core is handed."""

    def __init__(self, core, peer=None, now: float = 0.0):
        self.core = core
        self.peer = local_peer() if peer is None else peer
        self.rid = b"conn-%d" % next(_connections)
        self.now = now

    def ask(self, message) -> dict | None:
        import msgpack

        frame = message if isinstance(message, bytes) else msgpack.packb(message)
        reply = self.core.handle(self.rid, self.peer, frame, self.now)
        return None if reply is None else msgpack.unpackb(reply)

    def hello(self, nonce: str, **extra) -> dict:
        """A hello as ``raw_hello`` sends it (instance ``claimer``, 4 KiB pages unless given)."""
        return self.ask({"op": "hello", "id": extra.pop("id", 1), "versions": [1],
                         "instance": extra.pop("instance", "claimer"), "pid": extra.pop("pid", self.peer.pid),
                         "page_bytes": extra.pop("page_bytes", 4096), "nonce": nonce, **extra})

    def status(self) -> dict:
        reply = self.ask({"op": "status", "id": 1 << 40})
        assert reply["ok"], reply
        return reply["result"]


class CoreSession(CoreConnection):
    """A session opened with ``hello`` on its own connection to a request core, as a client
    with no credit reserve opens one: :meth:`request` numbers the ids and adds the token."""

    def __init__(self, core, instance: str = "m", *, page_bytes: int = 2 * MIB, peer=None, now: float = 0.0,
                 nonce: str | None = None, **hello):
        super().__init__(core, peer, now)
        reply = self.hello(nonce or f"nonce-{self.rid.decode()}", instance=instance, page_bytes=page_bytes, **hello)
        assert reply["ok"], reply
        self.opened = reply["result"]
        self.token = self.opened["session"]
        self.session_id = self.opened["session_id"]
        self._ids = itertools.count(2)

    @property
    def session(self):
        """The ledger's session."""
        return self.core.ledger.sessions[self.session_id]

    def request(self, op: str, **fields) -> dict:
        return self.ask({"op": op, "id": next(self._ids), "session": self.token, **fields})

    def result(self, op: str, **fields) -> dict:
        reply = self.request(op, **fields)
        assert reply["ok"], reply
        return reply["result"]

    def error(self, op: str, **fields) -> dict:
        reply = self.request(op, **fields)
        assert not reply["ok"], reply
        return reply["error"]

    def acquire(self, pages: int, min_pages: int | None = None) -> int:
        """Pages granted: 0 when refused (all or nothing, or at least ``min_pages``)."""
        extra = {} if min_pages is None else {"min_pages": min_pages}
        return self.result("acquire", pages=pages, **extra)["granted"]


def ledger_fingerprint(ledger) -> tuple:
    """Everything a refused request must leave as it was: totals, sessions' holdings, limits."""
    return (
        ledger.reserved_bytes, ledger.granted_bytes, ledger.unreported_bytes, dict(ledger.limits),
        {sid: (dict(s.pools), dict(s.holds), s.granted_pages, s.reserve_pages, s.state) for sid, s in ledger.sessions.items()},
    )


# ----------------------------------------------------------------------------- brokers over sockets
def connect(b, instance="m", **kw):
    """A client of broker ``b`` (any fixture with an ``endpoint``), with no credit reserve by default."""
    from kvcached_broker.client import BrokerClient

    kw.setdefault("credit_pages", 0)
    return BrokerClient.connect(instance, endpoint=b.endpoint, **kw)


def set_timeout(client, total_s: float) -> None:
    """Give a connected ``BrokerClient`` another request timeout: a test connects with a
    generous one and shortens it only where nothing can answer (a broker killed or stopped),
    so that waiting for the timeout is the point, and a slow machine cannot change the outcome."""
    from kvcached_broker.client.transport import Timeouts

    client._transport.timeouts = Timeouts.from_env(total_s)


def raw_dealer(endpoint):
    """A bare ZeroMQ DEALER on ``endpoint``: frames as a client of any language would send them."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 60_000)  # bounds a failure only: a reply ends the wait
    sock.connect(endpoint)
    return sock


def raw_ask(sock, message: dict) -> dict:
    """Send ``message`` as plain MessagePack and return the decoded reply."""
    import msgpack

    sock.send(msgpack.packb(message))
    return msgpack.unpackb(sock.recv())


def raw_hello(sock, nonce: str, **extra) -> dict:
    return raw_ask(sock, {"op": "hello", "id": 1, "versions": [1], "instance": extra.pop("instance", "claimer"),
                          "pid": os.getpid(), "page_bytes": extra.pop("page_bytes", 4096), "nonce": nonce, **extra})


# ----------------------------------------------------------------------------- broker processes
# A broker process is started by ``tools/launch.py``'s BrokerLauncher (conftest's ``broker``
# fixtures, or directly); CLI runs the other commands.
CLI = [sys.executable, "-m", "kvcached_broker.broker.cli"]


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- worker processes
WORKER = str(Path(__file__).with_name("worker_proc.py"))


class Worker:
    """A worker process (``worker_proc.py``) holding ``pools`` and ``pages``; ``query()`` asks for its books."""

    def __init__(self, endpoint: str, instance: str, pools: dict, pages: int, page_bytes: int = 2 * MIB):
        self.proc = subprocess.Popen(
            [sys.executable, WORKER, endpoint, instance, json.dumps(pools), str(pages), str(page_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        line = self.proc.stdout.readline()
        assert line, f"worker {instance} exited early ({self.proc.poll()})"
        self.ready = json.loads(line)
        self.session_id = self.ready["session_id"]
        self.charged = sum(pools.values()) + pages * page_bytes

    def query(self) -> dict:
        self.proc.stdin.write("?\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def reserve(self, pools: dict, holds: dict | None = None, phase: str | None = None) -> dict:
        """Reserve ``pools`` and ``holds`` (the worker's whole maps) in the worker process."""
        self.proc.stdin.write(json.dumps({"pools": pools, "holds": holds, "phase": phase}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def signal(self, sig) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def session_of(status: dict, session_id: str) -> dict | None:
    for inst in status["instances"]:
        for s in inst["sessions"]:
            if s["id"] == session_id:
                return s
    return None


def journal_records(path: Path) -> list[dict]:
    """The journal as documented: ``[u32 length][u32 CRC-32][MessagePack map]`` records."""
    import zlib

    import msgspec

    data, offset, records = path.read_bytes(), 0, []
    while offset < len(data):
        length = int.from_bytes(data[offset : offset + 4], "little")
        crc = int.from_bytes(data[offset + 4 : offset + 8], "little")
        payload = data[offset + 8 : offset + 8 + length]
        assert zlib.crc32(payload) == crc, f"record at {offset} fails its checksum"
        records.append(msgspec.msgpack.decode(payload))
        offset += 8 + length
    return records


def adapter_line(line: str, level: str, event: str) -> bool:
    """True if ``line`` is an adapter's line for operators: ``kvcached-broker: LEVEL DATE TIME
    event=EVENT ...`` (adapters/announce.py)."""
    return re.match(rf"kvcached-broker: {level} \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{{3}} event={event}( |$)",
                    line) is not None


class KvcachedAllocator:
    """kvcached's allocator as a pool governor reads it: its size and what is in use (pages)."""

    def __init__(self, total: int):
        self.total, self.inuse = total, 1

    def get_num_total_pages(self) -> int:
        return self.total

    def get_num_inuse_pages(self) -> int:
        return self.inuse


class FixedGrants:
    """A governor's grants that hold 40 pages and never talk to a broker (the whole ``Grants``
    interface of adapters/kvcached/grants.py: every call is accepted and changes nothing)."""

    pages = 40
    maps_here = False
    ratio = 1

    def lost(self) -> str | None:
        return None

    def acquire(self, pages: int, min_pages: int, *, wait_s: float | None = None) -> int | None:
        return 0

    def release(self, pages: int, *, mapped: int | None = None, key: str | None = None) -> bool:
        return True

    def mapped(self, key: str, pages: int) -> None:
        pass

    def idle(self, key: str, pages: int) -> None:
        pass

    def uncharged_pages(self) -> int:
        return 0

    def unasked_shortfall(self) -> int:
        return 0

    def report(self, key: str, pools: dict, *, usage: dict | None = None, allocated: bool = True) -> bool:
        return True

    def forget(self, key: str) -> None:
        pass

    def forget_report(self, key: str) -> None:
        pass

    def poll(self) -> int:
        return 0


class BackgroundThread:
    """A daemon thread that runs a subclass's ``_run()`` while the object is used as a context
    manager (the tests' samplers): started on entry; on exit ``_stop`` is set and the thread
    joined, for at most ``join_timeout_s``.  ``_run`` returns once ``_stop`` is set, waiting on
    it (never sleeping) between rounds."""

    join_timeout_s = 30.0

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=self.join_timeout_s)

    def _run(self) -> None:
        raise NotImplementedError
