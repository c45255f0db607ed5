"""The broker daemon's shell: lifecycle, the receive loop, framing and timers.

Everything the broker decides is decided by its collaborators: the request core's are wired by
:func:`.request_core.build_core`, the shell's here, once, by :class:`BrokerServer`:

* ``RequestCore`` (``request_core``): requests in, replies out, no I/O;
* ``Journal`` / ``NullJournal`` (``journal``): group commit, deferral, snapshots and replay;
* ``DeviceMonitor`` (``device_monitor``): device readings into the ledger;
* ``PidfdProcesses`` and ``WakeupThread`` (``wakeups``): the ``ProcessOps`` the core uses, and
  process exits and wake-ups delivered as messages on the broker's own socket.

One thread runs :meth:`BrokerServer.serve_forever`.  Each round it

1. waits in one blocking ``recv`` on the ROUTER socket (up to a timeout), then reads the
   requests waiting behind the first (up to ``max_batch``) and hands each to the core; a
   message from the wake-up thread hands the core a pid that exited, or just wakes the loop,
2. runs the timers that are due, and grants the asks waiting for memory that fit now (or
   answers those whose wait is over),
3. commits what changed to the journal with one ``write()`` (group commit), and only then
4. sends the round's replies and pushes,

so that no grant is ever answered before it would survive a broker crash.  The loop is
synchronous on purpose (zmq.asyncio measured slower; see docs/performance.md).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import zmq
import zmq.backend

from .. import broker as _package
from ..client import protocol as proto
from ..client import results
from ..client.endpoint import ipc_path, tcp_host
from ..client.units import format_bytes
from .counters import Counters
from .connections import (
    ConnectionBook,
    ConnectionBounds,
    ConnectionMonitor,
    OpenFiles,
    connection_bounds,
    raise_open_files_limit,
)
from .device import DeviceProbe
from .reply_budget import LARGE_REPLY_BYTES, REPLIES_PER_CONNECTION, ReplyBudget
from .journal import RETRY_WRITE_S
from .request_core import build_core
from .sdnotify import Notifier
from .security import (
    LockFile,
    Peer,
    SecurityError,
    is_admin,
    is_loopback,
    parse_peer_address,
    prepare_socket_dir,
    secure_socket_file,
    socket_umask,
)
from .config import ServeConfig
from .wakeups import PidfdProcesses, WakeupThread, parse_wakeup

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("kvcached_broker")

# Plain ints for zmq's flags on the request path (docs/performance.md).
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
#: The compiled send underneath pyzmq's Python wrapper, which only adds routing-id handling
#: for SERVER/RADIO sockets (docs/performance.md has what it saves).
_raw_send = zmq.backend.Socket.send
_POLL_TIMEOUT_MS = 100
#: While asks wait for memory, a round runs at least this often (their deadlines, readings).
_WAITING_TIMEOUT_MS = 10
#: How often the watermarks are checked (``RequestCore.replenish``).
REPLENISH_S = 0.01
#: A first receive that took longer than this waited for its message: the queue was empty,
#: so unless the round before was a batch, the round does not ask whether more wait behind it
#: (a ``ZMQ_EVENTS`` read is about a tenth of a ping-pong's instructions, docs/performance.md);
#: the next round takes any.
_WAITED_S = 20e-6
_MAX_PEERS = 16384
#: Requests waiting in one connection's queue (the ROUTER's RCVHWM): past it libzmq stops
#: reading that connection until the broker catches up, so a peer buffers at most this many
#: requests of at most MAX_REQUEST_BYTES in the broker.
REQUESTS_PER_CONNECTION = 16


class _Timer:
    """Runs ``job(now)`` at most every ``interval_s``."""

    def __init__(self, interval_s: float, job: Callable[[float], Any]):
        self.interval_s = interval_s
        self.job = job
        self.next_s = 0.0

    def run(self, now: float) -> None:
        if now >= self.next_s:
            self.next_s = now + self.interval_s
            self.job(now)


class BrokerServer:
    def __init__(
        self,
        config: ServeConfig,
        probe: DeviceProbe,
        *,
        clock: Callable[[], float] = time.monotonic,
        notifier: Notifier | None = None,
    ):
        self.config = config
        self.clock = clock
        self.notifier = notifier or Notifier({})
        self.processes = PidfdProcesses()
        self.core = build_core(
            probe, self.processes, headroom=config.headroom, is_admin=lambda peer: is_admin(peer, config.admin_group),
            quotas=config.quotas(), state_dir=config.state_dir, device_index=config.device_index,
            meta={"version": _package.__version__, "pid": os.getpid(), "endpoint": config.endpoint,
                  "state_dir": str(config.state_dir) if config.state_dir else None},
            started_s=clock(),
        )
        self.device, self.ledger, self.table, self.journal = (
            self.core.device, self.core.ledger, self.core.table, self.core.journal
        )
        self._peers: dict[bytes, Peer] = {}
        self._locks: list[LockFile] = []
        self.open_files: OpenFiles | None = None  # RLIMIT_NOFILE, raised at start
        self._connections: ConnectionMonitor | None = None
        #: What ``/metrics`` serves with (its pool and what it refused), once it runs.
        self.metrics_view: Callable[[], dict[str, Any]] | None = None
        self.replies = ReplyBudget()
        self.core.shell_view = self._limits_view
        self._journal_open = False  # only a journal this broker restored may be written
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sock: zmq.Socket[bytes] | None = None
        self._auth: ThreadAuthenticator | None = None
        self._stopping = False
        self._wakeups: WakeupThread | None = None
        self._wakeup_rid = b""  # the wake-up thread's routing id on the ROUTER socket
        self._rcvtimeo_ms = -1
        self._batching = False  # the last round read more than one request
        self.ready = threading.Event()
        self._snapshot_requests: list[dict[str, Any]] = []
        self._timers_due_s = 0.0
        self._timers = [
            _Timer(min(1.0, config.lease_s / 10), self.core.expire_leases),
            _Timer(config.probe_interval_s, lambda now: self.device.observe(self.ledger, now)),
            _Timer(0.0, self.core.lift_growth_hold),
            _Timer(0.0, self.journal.flush_due),
            _Timer(RETRY_WRITE_S, self.journal.retry_failed_write),
            _Timer(0.0, self.core.expire_pressure),
            _Timer(REPLENISH_S, self.core.replenish),
        ]

    @property
    def counters(self) -> Counters:
        return self.core.counters

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Take the locks, restore state, bind.  Raises with a one-line reason on failure."""
        cfg = self.config
        sock_path = ipc_path(cfg.endpoint)
        self.open_files = raise_open_files_limit()
        try:
            if sock_path is not None:
                prepare_socket_dir(sock_path, cfg.socket_group)
                self._lock(Path(str(sock_path) + ".lock"), cfg.endpoint)
            else:
                self._check_tcp_allowed()
            if cfg.state_dir is not None:
                Path(cfg.state_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
                self._lock(Path(cfg.state_dir) / f"gpu{cfg.device_index}.lock", f"state directory {cfg.state_dir}")
            self.core.restore(self.journal.restore(), self.clock())
            self.journal.started()
            self._journal_open = True  # only now may close() write a snapshot over the old one
            self._apply_configured_limits()
            self._bind(sock_path)
        except BaseException:
            self.close()
            raise
        for pid in self.table.pids():
            self.core.lifecycle.watch(pid)
        self.device.observe(self.ledger, self.clock())
        log.info(
            "event=ready endpoint=%s device=%d uuid=%s total=%s budget=%s lease_s=%s state_dir=%s request_core=%s",
            cfg.endpoint, cfg.device_index, self.ledger.device.uuid, format_bytes(self.ledger.total_bytes),
            format_bytes(self.ledger.budget_bytes), cfg.lease_s, cfg.state_dir, _package.request_core_build(),
        )
        self.ready.set()

    def _apply_configured_limits(self) -> None:
        for instance, limit in self.config.limits.items():
            limits = self.ledger.set_limits(
                instance, max_bytes=limit.max_bytes, min_bytes=limit.min_bytes,
                weight=limit.weight, source="config", priority=limit.priority,
            )
            log.info("event=limits source=config instance=%s %s", instance,
                     " ".join(f"{key}={value}" for key, value in limits.to_dict().items()))

    def _lock(self, path: Path, what: str) -> None:
        lock = LockFile(path, what)
        lock.acquire()
        self._locks.append(lock)

    def _check_tcp_allowed(self) -> None:
        cfg = self.config
        if cfg.curve_dir is not None:
            return
        host = tcp_host(cfg.endpoint) or ""
        if not cfg.insecure_tcp:
            raise SecurityError(
                f"refusing to serve {cfg.endpoint} without CURVE keys; use an ipc:// endpoint, "
                "configure CURVE, or pass --insecure-tcp for a loopback address"
            )
        if not is_loopback(host):
            raise SecurityError(f"--insecure-tcp is allowed only on a loopback address, not {host}")
        log.warning("event=insecure_tcp endpoint=%s detail=no_authentication_or_encryption", cfg.endpoint)

    def _bind(self, sock_path: Path | None) -> None:
        cfg = self.config
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, proto.MAX_REQUEST_BYTES)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.HANDSHAKE_IVL, 5000)
        sock.setsockopt(zmq.SNDHWM, REPLIES_PER_CONNECTION)
        sock.setsockopt(zmq.RCVHWM, REQUESTS_PER_CONNECTION)
        self._sock = sock  # from here on close() closes it, or the context would never end
        self._connections = ConnectionMonitor(self._ctx, sock, ConnectionBook(self._connection_bounds()))
        if cfg.curve_dir is not None and sock_path is None:
            self._start_curve(sock, Path(cfg.curve_dir))
        if sock_path is not None:
            with socket_umask():
                sock.bind(cfg.endpoint)
            secure_socket_file(sock_path, cfg.socket_group)
        else:
            sock.bind(cfg.endpoint)
        inproc = f"inproc://kvcached-broker-wakeups-{id(self):x}"
        sock.bind(inproc)
        self._wakeups = WakeupThread(self._ctx, inproc)
        self._wakeup_rid = self._wakeups.routing_id
        self.processes.attach(self._wakeups)

    def _connection_bounds(self) -> ConnectionBounds:
        total, per_peer = self.config.connection_limits()
        assert self.open_files is not None
        bounds = connection_bounds(self.open_files.soft, total, per_peer)
        if bounds.max_total < total:
            log.warning("event=connections_bounded_by_open_files open_files=%d max_connections=%d configured=%d "
                        "detail=raise_the_hard_limit_LimitNOFILE_for_more", self.open_files.soft, bounds.max_total, total)
        return bounds

    def _limits_view(self) -> dict[str, Any]:
        """The bounds on what peers may hold of the broker, and what they met (status ``broker.limits``)."""
        return {
            "open_files": self.open_files.to_dict() if self.open_files is not None else None,
            "connections": self._connections.view() if self._connections is not None else None,
            "requests": {"max_bytes": proto.MAX_REQUEST_BYTES, "per_connection": REQUESTS_PER_CONNECTION},
            "replies": self.replies.view(),
            "reply_cache": self.core.table.reply_cache_view(),
            "metrics": self.metrics_view() if self.metrics_view is not None else None,
        }

    def _start_curve(self, sock: zmq.Socket[bytes], curve_dir: Path) -> None:
        """CURVE on tcp: the broker's key pair, and only clients whose public key is authorised."""
        import zmq.auth
        from zmq.auth.thread import ThreadAuthenticator

        secret_file = curve_dir / "server.key_secret"
        authorized = curve_dir / "authorized"
        try:
            public, secret = zmq.auth.load_certificate(secret_file)
        except (OSError, ValueError) as exc:
            raise SecurityError(f"cannot load the broker's CURVE key {secret_file}: {exc}") from None
        if secret is None or not authorized.is_dir():
            raise SecurityError(f"{curve_dir} needs server.key_secret and an authorized/ directory of client keys")
        self._auth = ThreadAuthenticator(self._ctx)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=str(authorized))
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True

    def stop(self) -> None:
        """Ask :meth:`serve_forever` to return (thread- and signal-safe)."""
        self._stopping = True
        wakeups = self._wakeups
        if wakeups is not None:
            wakeups.wake()

    def close(self) -> None:
        if self._journal_open:
            self._journal_open = False
            self.journal.close()
        self.processes.close()  # the wake-up thread's socket goes before the context
        self._wakeups = None
        if self._connections is not None:
            self._connections.close()  # its monitor socket too
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        sock_path = ipc_path(self.config.endpoint)
        if sock_path is not None and self._locks:
            try:
                sock_path.unlink()
            except OSError:
                pass
        for lock in self._locks:
            lock.release()
        self._locks.clear()

    def serve_forever(self) -> None:
        if not self.ready.is_set():
            self.start()
        try:
            self.run_round(timeout_ms=0)  # the loop is live: status requests are answered from here on
            self.notifier.ready(self._summary())
            self._timers.append(_Timer(5.0, lambda now: self.notifier.status(self._summary())))
            if self.notifier.watchdog_interval_s:
                self._timers.append(_Timer(self.notifier.watchdog_interval_s, lambda now: self.notifier.watchdog()))
            while not self._stopping:
                self.run_round()
        finally:
            log.info("event=stopping sessions=%d", len(self.table))
            self.notifier.stopping()
            self.close()
            self.notifier.close()

    def _summary(self) -> str:
        led = self.ledger
        return (
            f"serving GPU {led.device.index}: {len(led.sessions)} session(s), "
            f"{format_bytes(led.free_bytes)} free of {format_bytes(led.budget_bytes)}"
            + (" (overcommitted)" if led.overcommitted else "")
        )

    def snapshot(self, timeout_s: float = 5.0) -> dict[str, Any] | None:
        """The status document, computed by the server thread (thread-safe; for metrics)."""
        box: dict[str, Any] = {"done": threading.Event()}
        self._snapshot_requests.append(box)
        wakeups = self._wakeups
        if wakeups is None:
            return None
        wakeups.wake()
        return box["status"] if box["done"].wait(timeout_s) else None

    # ---------------------------------------------------------------- rounds
    def run_round(self, timeout_ms: int = _POLL_TIMEOUT_MS) -> None:
        """Wait up to ``timeout_ms`` for a request (or a wake-up), then serve one round."""
        replies: list[tuple[bytes, bytes]] = []
        sock = self._sock
        assert sock is not None
        if self.core.waiting:
            timeout_ms = min(timeout_ms, _WAITING_TIMEOUT_MS)
        if timeout_ms != self._rcvtimeo_ms:
            sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
            self._rcvtimeo_ms = timeout_ms
        waiting_from = time.perf_counter()
        try:
            rid = sock.recv()  # the first message's routing id frame
        except zmq.Again:
            rid = None
        started = time.perf_counter()
        now = self.clock()
        if rid is not None:
            ask_for_more = self._batching or started - waiting_from < _WAITED_S
            self._batching = self._read_requests(rid, now, replies, ask_for_more) > 1
        if now >= self._timers_due_s:
            # The every-round jobs run at most once a millisecond: one check per round, not five calls.
            self._timers_due_s = now + 0.001
            for timer in self._timers:
                timer.run(now)
        if self.core.waiting:
            self.core.serve_waiting(now)
        self.journal.commit(now)
        self._send(replies)
        if replies:
            # One sample per request: the round's service time (group commit makes it shared).
            self.core.counters.latency.observe(time.perf_counter() - started, len(replies))
        if self._snapshot_requests:
            self._answer_snapshots(now)

    def _answer_snapshots(self, now: float) -> None:
        requests, self._snapshot_requests = self._snapshot_requests, []
        status = results.as_map(self.core.status(now))
        for box in requests:
            box["status"] = status
            box["done"].set()

    def _read_requests(self, rid: bytes, now: float, replies: list[tuple[bytes, bytes]], ask_for_more: bool) -> int:
        """Handle the message ``rid`` starts and, if ``ask_for_more``, those waiting behind it,
        up to ``max_batch``; returns how many requests it read."""
        sock = self._sock
        assert sock is not None
        recv = sock.recv
        peers = self._peers
        counters = self.core.counters
        handle = self.core.handle
        max_batch = self.config.max_batch
        count = 0
        while True:
            frame = recv(_NOBLOCK, copy=False)  # a Frame: its properties carry the peer's credentials
            count += 1
            extra = frame.more
            while extra and sock.get(_RCVMORE):
                recv(_NOBLOCK)
            peer = peers.get(rid)
            if peer is None and rid == self._wakeup_rid:  # the wake-up thread: never a request
                self._on_wakeup(frame.bytes)
                count -= 1
            else:
                if peer is None:
                    peer = self._learn_peer(rid, frame)
                if extra:
                    counters.bad_frames += 1
                    replies.append((rid, proto.error_reply(None, "bad_request", "a request is exactly one frame")))
                else:
                    reply = handle(rid, peer, frame.bytes, now)
                    if reply is not None:
                        replies.append((rid, reply))
            if count >= max_batch:
                break
            # A round whose receive waited, after a round of one, takes one request; otherwise
            # ask whether more are waiting rather than fail a receive (docs/performance.md).
            # Past the first, read on until Again.
            if count <= 1 and not (ask_for_more and int(sock.get(_EVENTS)) & _POLLIN):
                break
            try:
                rid = recv(_NOBLOCK)
            except zmq.Again:
                break
        counters.requests += count
        return count

    def _on_wakeup(self, body: bytes) -> None:
        pid = parse_wakeup(body)
        if pid is not None:
            self.core.reclaim_pid(pid)

    def _learn_peer(self, rid: bytes, frame: zmq.Frame) -> Peer:
        try:
            value = frame.get("Peer-Address")
        except zmq.ZMQError:
            value = None
        address = value if isinstance(value, str) else None
        peer = parse_peer_address(address)
        if len(self._peers) >= _MAX_PEERS:
            bound = {b.routing_id for b in self.table}
            self._peers = {k: v for k, v in self._peers.items() if k in bound}
        self._peers[rid] = peer
        return peer

    def _send(self, replies: list[tuple[bytes, bytes]]) -> None:
        sock = self._sock
        if sock is None:
            return
        if self.core.has_pushes():
            replies = replies + self.core.take_pushes()
        send = _raw_send.__get__(sock)
        for rid, reply in replies:
            try:
                if len(reply) > LARGE_REPLY_BYTES:
                    self._send_large(send, rid, reply)
                    continue
                send(rid, _SNDMORE_NOBLOCK)
                send(reply, _NOBLOCK)
            except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer left; EAGAIN: it is not reading
                self._dropped(exc)

    def _send_large(self, send: Callable[..., Any], rid: bytes, reply: bytes) -> None:
        """A large reply (a status document) goes without a copy, within the budget of what may
        wait unread (broker/reply_budget.py), tracked until libzmq lets go of it."""
        peer = self._peers.get(rid)
        key = (peer.uid, None) if peer is not None and peer.uid is not None else (None, peer.address if peer else "")
        if self.replies.admit(rid, key, len(reply)) is not None:
            return
        send(rid, _SNDMORE_NOBLOCK)
        tracker = send(reply, _NOBLOCK, copy=False, track=True)
        self.replies.sent(rid, key, len(reply), lambda: tracker.done)

    def _dropped(self, exc: zmq.ZMQError) -> None:
        if exc.errno == errno.EAGAIN:
            self.replies.drop("queue_full")
        log.debug("event=reply_dropped errno=%s", exc.errno)
