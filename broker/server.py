"""The broker daemon's shell: lifecycle, the poll loop, framing, pidfds and timers.

Everything the broker decides is decided by its collaborators, wired here once
(:class:`BrokerServer` is the composition root):

* ``RequestCore`` (``request_core``): requests in, replies out, no I/O;
* ``Journal`` / ``NullJournal`` (``journal``): group commit, deferral, snapshots and replay;
* ``DeviceMonitor`` (``device_monitor``): device readings into the ledger;
* ``PidfdProcesses`` (here): the ``ProcessOps`` the core uses, on ``/proc`` and pidfds.

One thread runs :meth:`BrokerServer.serve_forever`.  Each poll round it

1. reads the requests waiting on the ROUTER socket (up to ``max_batch``) and hands each to the
   core, and hands the core the pids whose pidfds say they exited,
2. runs the timers that are due,
3. commits what changed to the journal with one ``write()`` (group commit), and only then
4. sends the round's replies and pushes,

so that no grant is ever answered before it would survive a broker crash.  The poller is
synchronous on purpose (zmq.asyncio measured slower; see docs/performance.md).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import zmq
import zmq.backend
from zmq.backend import zmq_poll

from .. import broker as _package
from ..client import protocol as proto
from ..client.endpoint import ipc_path, tcp_host
from ..client.units import format_bytes
from .device import DeviceProbe
from .liveness import PidWatcher, process_alive, process_start_ticks
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
from .session_opener import SessionQuotas

log = logging.getLogger("kvcached_broker")

# Plain ints: enum arithmetic on zmq's flags is not free, and the request path uses them.
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)
#: The compiled send underneath pyzmq's Python wrapper, which only adds routing-id handling
#: for SERVER/RADIO sockets (docs/performance.md has what it saves).
_raw_send = zmq.backend.Socket.send
_POLL_TIMEOUT_MS = 100
_MAX_PEERS = 16384


@dataclass
class ServeConfig:
    """Everything ``serve`` can be told.  Sizes in bytes, times in seconds."""

    endpoint: str
    device_index: int = 0
    headroom: str = "5%"
    state_dir: Path | None = None
    lease_s: float = 10.0
    socket_group: int | None = None
    admin_group: int | None = None
    insecure_tcp: bool = False
    curve_dir: Path | None = None  # server.key_secret + authorized/*.key (client public keys)
    probe_interval_s: float = 0.5
    max_sessions: int = 4096
    max_sessions_per_pid: int = 64
    max_sessions_per_uid: int = 1024
    hello_rate_per_s: float = 50.0
    hello_burst: int = 200
    #: Requests a round answers before it writes the journal and sends its replies.  Small, so
    #: replies keep flowing while later requests wait (a round that swallowed every request in
    #: flight would leave all clients idle until it ends); still enough to share one write.
    max_batch: int = 16
    limits: dict[str, Any] = field(default_factory=dict)  # instance -> config.LimitConfig, applied at start

    def quotas(self) -> SessionQuotas:
        return SessionQuotas(
            lease_s=self.lease_s, max_sessions=self.max_sessions, max_sessions_per_pid=self.max_sessions_per_pid,
            max_sessions_per_uid=self.max_sessions_per_uid, hello_rate_per_s=self.hello_rate_per_s,
            hello_burst=self.hello_burst,
        )


class PidfdProcesses:
    """``ProcessOps`` on a real machine: ``/proc`` for start times, pidfds in the shell's poller."""

    def __init__(self, poll_items: list[tuple[Any, int]]):
        self._watcher = PidWatcher()
        self._poll_items = poll_items  # shared with the shell, which polls it

    def start_ticks(self, pid: int) -> int | None:
        return process_start_ticks(pid)

    def alive(self, pid: int, start_ticks: int | None) -> bool:
        return process_alive(pid, start_ticks)

    def kill(self, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)

    def watch(self, pid: int) -> bool:
        try:
            fd = self._watcher.watch(pid)
        except ProcessLookupError:
            return False
        except OSError as exc:
            log.warning("event=pidfd_unavailable pid=%d error=%s detail=lease_only", pid, exc.strerror)
            return True
        if fd is not None:
            self._poll_items.append((fd, zmq.POLLIN))
        return True

    def unwatch(self, pid: int) -> None:
        fd = self._watcher.unwatch(pid)
        if fd is not None:
            self._poll_items[:] = [item for item in self._poll_items if item[0] != fd]

    def pid_of(self, fd: int) -> int | None:
        return self._watcher.pid_of(fd)

    def close(self) -> None:
        self._watcher.close()


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
        self._poll_items: list[tuple[Any, int]] = []  # the ROUTER socket, the wake pipe, then pidfds
        self.processes = PidfdProcesses(self._poll_items)
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
        self._journal_open = False  # only a journal this broker restored may be written
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._auth = None
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self.ready = threading.Event()
        self._snapshot_requests: list[dict[str, Any]] = []
        self._saturated = False  # the last read stopped at max_batch, not at an empty socket
        self._next_fd_glance_s = 0.0
        self._timers = [
            _Timer(min(1.0, config.lease_s / 10), self.core.expire_leases),
            _Timer(config.probe_interval_s, lambda now: self.device.observe(self.ledger, now)),
            _Timer(0.0, self.core.lift_growth_hold),
            _Timer(0.0, self.journal.flush_due),
            _Timer(0.0, self.core.expire_pressure),
        ]

    @property
    def counters(self):
        return self.core.counters

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Take the locks, restore state, bind.  Raises with a one-line reason on failure."""
        cfg = self.config
        sock_path = ipc_path(cfg.endpoint)
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
        self._poll_items[:0] = [(self._sock, zmq.POLLIN), (self._wake_r, zmq.POLLIN)]
        for pid in self.table.pids():
            self.core.lifecycle.watch(pid)
        self.device.observe(self.ledger, self.clock())
        log.info(
            "event=ready endpoint=%s device=%d uuid=%s total=%s budget=%s lease_s=%s state_dir=%s",
            cfg.endpoint, cfg.device_index, self.ledger.device.uuid, format_bytes(self.ledger.total_bytes),
            format_bytes(self.ledger.budget_bytes), cfg.lease_s, cfg.state_dir,
        )
        self.ready.set()

    def _apply_configured_limits(self) -> None:
        for instance, limit in self.config.limits.items():
            limits = self.ledger.set_limits(
                instance, max_bytes=None if limit.clear_max else limit.max_bytes, min_bytes=limit.min_bytes,
                weight=limit.weight, source="config",
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
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        if cfg.curve_dir is not None and sock_path is None:
            self._start_curve(sock, Path(cfg.curve_dir))
        self._sock = sock
        if sock_path is not None:
            with socket_umask():
                sock.bind(cfg.endpoint)
            secure_socket_file(sock_path, cfg.socket_group)
        else:
            sock.bind(cfg.endpoint)

    def _start_curve(self, sock: zmq.Socket, curve_dir: Path) -> None:
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
        self._stop.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def close(self) -> None:
        if self._journal_open:
            self._journal_open = False
            self.journal.close()
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
        self.processes.close()
        for lock in self._locks:
            lock.release()
        self._locks.clear()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1

    def serve_forever(self) -> None:
        if not self.ready.is_set():
            self.start()
        try:
            self.run_round(timeout_ms=0)  # the loop is live: status requests are answered from here on
            self.notifier.ready(self._summary())
            self._timers.append(_Timer(5.0, lambda now: self.notifier.status(self._summary())))
            if self.notifier.watchdog_interval_s:
                self._timers.append(_Timer(self.notifier.watchdog_interval_s, lambda now: self.notifier.watchdog()))
            while not self._stop.is_set():
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
        try:
            os.write(self._wake_w, b"s")
        except OSError:
            return None
        return box["status"] if box["done"].wait(timeout_s) else None

    def status(self, now: float | None = None) -> dict[str, Any]:
        return self.core.status(self.clock() if now is None else now)

    # ---------------------------------------------------------------- rounds
    def run_round(self, timeout_ms: int = _POLL_TIMEOUT_MS) -> None:
        replies: list[tuple[bytes, bytes]] = []
        started = time.perf_counter()
        now = self.clock()
        # Saturated (the last round stopped at max_batch): read on without a poll call, and
        # glance at the pidfds every millisecond.  Otherwise the socket was drained: poll.
        if self._saturated and self._read_requests(now, replies):
            if now >= self._next_fd_glance_s:
                self._next_fd_glance_s = now + 0.001
                self._dispatch(zmq_poll(self._poll_items[1:], 0), now, replies)
        else:
            events = zmq_poll(self._poll_items, timeout_ms)
            started = time.perf_counter()
            now = self.clock()
            self._dispatch(events, now, replies)
        for timer in self._timers:
            timer.run(now)
        self.journal.commit(now)
        self._send(replies)
        if replies:
            # One sample per request: the round's service time (group commit makes it shared).
            self.core.counters.latency.observe(time.perf_counter() - started, len(replies))
        if self._snapshot_requests:
            self._answer_snapshots(now)

    def _dispatch(self, events: list[tuple[Any, int]], now: float, replies: list[tuple[bytes, bytes]]) -> None:
        for target, _ in events:
            if target is self._sock:
                self._read_requests(now, replies)
            elif target == self._wake_r:
                os.read(self._wake_r, 4096)
            else:
                pid = self.processes.pid_of(target)
                if pid is not None:
                    self.core.reclaim_pid(pid)

    def _answer_snapshots(self, now: float) -> None:
        requests, self._snapshot_requests = self._snapshot_requests, []
        status = self.core.status(now)
        for box in requests:
            box["status"] = status
            box["done"].set()

    def _read_requests(self, now: float, replies: list[tuple[bytes, bytes]]) -> int:
        """Handle every request waiting (up to ``max_batch``); returns how many were read."""
        sock = self._sock
        assert sock is not None
        recv = sock.recv
        peers = self._peers
        counters = self.core.counters
        handle = self.core.handle
        self._saturated = False
        for count in range(self.config.max_batch):
            try:
                rid = recv(_NOBLOCK)  # the ROUTER's routing id frame
            except zmq.Again:
                counters.requests += count
                return count
            frame = recv(_NOBLOCK, copy=False)  # a Frame: its properties carry the peer's credentials
            extra = frame.more
            while extra and sock.get(_RCVMORE):
                recv(_NOBLOCK)
            peer = peers.get(rid)
            if peer is None:
                peer = self._learn_peer(rid, frame)
            if extra:
                counters.bad_frames += 1
                replies.append((rid, proto.error_reply(None, "bad_request", "a request is exactly one frame")))
                continue
            reply = handle(rid, peer, frame.bytes, now)
            if reply is not None:
                replies.append((rid, reply))
        self._saturated = True
        counters.requests += self.config.max_batch
        return self.config.max_batch

    def _learn_peer(self, rid: bytes, frame: zmq.Frame) -> Peer:
        try:
            address = frame.get("Peer-Address")
        except zmq.ZMQError:
            address = None
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
                send(rid, _SNDMORE_NOBLOCK)
                send(reply, _NOBLOCK)
            except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer left; EAGAIN: it is not reading
                log.debug("event=reply_dropped errno=%s", exc.errno)
