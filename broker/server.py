"""The broker daemon: a thin synchronous shell around the ledger.

One thread runs :meth:`BrokerServer.serve_forever`.  Each poll round it

1. reads every request waiting on the ROUTER socket and decides each one against the ledger,
2. reclaims sessions whose process exited (pidfds in the same poller),
3. appends what changed to the journal with one ``write()`` (group commit), and only then
4. sends the round's replies,

so that no grant is ever answered before it would survive a broker crash.  Timers (leases,
device readings, snapshots) run between rounds.  A synchronous poller is used on purpose:
zmq.asyncio halved throughput when measured.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

import msgspec
import zmq
import zmq.backend
from zmq.backend import zmq_poll

from ..client import protocol as proto
from ..client.credit import split_grant
from ..client.endpoint import ipc_path, tcp_host
from ..client.errors import (
    BadRequest,
    BrokerError,
    Forbidden,
    NotOwner,
    RateLimited,
    SessionEvicted,
    UnknownSession,
    UnsupportedVersion,
    WrongDevice,
)
from ..client.units import format_bytes, parse_headroom
from .checkpoint import LoadedState, StateStore
from .device import DeviceProbe, SimulatedDevice
from .histogram import Histogram
from .ledger import KEEP, Claim, Ledger, Limits, Session, SessionState
from .liveness import PidWatcher, process_alive, process_start_ticks
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
from .sessions import Binding, HelloRateLimiter, SessionTable
from .policy import PressureBook, fair_shares
from .sdnotify import Notifier
from .state_records import (
    CloseRecord,
    FenceRecord,
    HoldRecord,
    JournalRecord,
    LimitRecord,
    SessionRecord,
    Snapshot,
    UnlimitRecord,
)
from .status import build_status

log = logging.getLogger("kvcached_broker")

# Plain ints: enum arithmetic on zmq's flags costs microseconds on the request path.
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)
_decode_request = msgspec.msgpack.Decoder(proto.AnyRequest).decode
#: The compiled send underneath pyzmq's Python wrapper (which only adds routing_id/group
#: handling for SERVER/RADIO sockets): a third of the cost per frame, and bytes frames only.
_raw_send = zmq.backend.Socket.send
#: How long decrease-only journal records may wait for the next durable write.
DEFER_S = 0.02
_encode = msgspec.msgpack.Encoder().encode
_LIVE = SessionState.LIVE  # an enum member lookup costs a metaclass call; every request makes this test


class Holdings(NamedTuple):
    """What a session's journal ``hold`` record carries, copied out of the ledger."""

    granted_pages: int
    reserve_pages: int
    pools: dict[str, int]
    usage: dict[str, int]
    holds: dict[str, int]

    @classmethod
    def of(cls, session: Session) -> "Holdings":
        return cls(session.granted_pages, session.reserve_pages, dict(session.pools), dict(session.usage),
                   dict(session.holds))

    def still(self, session: Session) -> bool:
        """Whether ``session`` holds exactly this (compared in place, without copying)."""
        return self == (session.granted_pages, session.reserve_pages, session.pools, session.usage, session.holds)

    def record(self, session_id: str) -> HoldRecord:
        return HoldRecord(session_id=session_id, pools=self.pools, granted_pages=self.granted_pages,
                          reserve_pages=self.reserve_pages, usage=self.usage, holds=self.holds)


class _Retried(Exception):
    """A request id the session was already answered for: send ``reply`` again, apply nothing."""

    def __init__(self, reply: bytes):
        super().__init__()
        self.reply = reply


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
    #: So that one member of the socket group cannot fill the table and lock others out.
    max_sessions_per_uid: int = 1024
    hello_rate_per_s: float = 50.0
    hello_burst: int = 200
    #: Requests a round answers before it writes the journal and sends its replies.  Small, so
    #: replies keep flowing while later requests wait (a round that swallowed every request in
    #: flight would leave all clients idle until it ends); still enough to share one write.
    max_batch: int = 16
    limits: dict[str, Any] = field(default_factory=dict)  # instance -> config.LimitConfig, applied at start


@dataclass
class Counters:
    """Monotonic counters for metrics and the closing benchmark notes."""

    requests: int = 0
    grants: int = 0
    refusals: dict[str, int] = field(default_factory=dict)
    reclaims: dict[str, int] = field(default_factory=dict)
    bad_frames: int = 0
    latency: Histogram = field(default_factory=Histogram)

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "grants": self.grants,
            "refusals": dict(self.refusals),
            "reclaims": dict(self.reclaims),
            "bad_frames": self.bad_frames,
            "request_latency": self.latency.to_dict(),
        }

    def refused(self, code: str) -> None:
        self.refusals[code] = self.refusals.get(code, 0) + 1

    def reclaimed(self, cause: str) -> None:
        self.reclaims[cause] = self.reclaims.get(cause, 0) + 1


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
        self.notifier = notifier or Notifier({})
        self.probe = probe
        self.clock = clock
        reading = probe.read()
        self._headroom_bytes, self._headroom_fraction = parse_headroom(config.headroom, reading.total_bytes)
        self.ledger = Ledger(
            probe.info,
            total_bytes=reading.total_bytes,
            headroom_bytes=self._headroom_bytes or 0,
            external_bytes=reading.external_for((), 0),
        )
        self.table = SessionTable()
        self.counters = Counters()
        self.pressure = PressureBook()
        self._hellos = HelloRateLimiter(config.hello_rate_per_s, config.hello_burst)
        self._pids = PidWatcher()
        self._peers: dict[bytes, Peer] = {}
        self._store: StateStore | None = None
        self._locks: list[LockFile] = []
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._auth = None
        self._poll_items: list[tuple[Any, int]] = []  # the ROUTER socket, the wake pipe, then pidfds
        self._pushes: list[tuple[bytes, bytes]] = []
        self._pending_records: list[JournalRecord] = []
        # Sessions whose full record is in the snapshot or journal, each with the holdings its
        # latest record there carries (None: not known here, so the next change is written).
        self._on_disk: dict[str, Holdings | None] = {}
        self._deferred: list[JournalRecord] = []  # decrease-only records not yet written
        self._defer_until_s = 0.0
        self._started_s = clock()
        self._next_probe_s = 0.0
        self._next_lease_check_s = 0.0
        self._was_overcommitted = False
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self.ready = threading.Event()
        self._snapshot_requests: list[dict[str, Any]] = []
        self._next_notify_s = 0.0
        self._notify_ready = False  # systemd hears STATUS/WATCHDOG only after READY
        self._next_fd_glance_s = 0.0
        self._saturated = False  # the last read stopped at max_batch, not at an empty socket
        self._next_watchdog_s = 0.0
        self._body = b""  # the request being handled
        self.state_damage: dict[str, Any] | None = None  # what the last restore found damaged
        self._hold_until_s = 0.0  # growth held (damaged state) until then at the latest
        self._handlers = {
            proto.Hello: self._hello,
            proto.Reserve: self._reserve,
            proto.Acquire: self._acquire,
            proto.Release: self._release,
            proto.Heartbeat: self._heartbeat,
            proto.Close: self._close,
            proto.Status: self._status,
            proto.SetLimit: self._set_limit,
            proto.Evict: self._evict,
            proto.Simulate: self._simulate,
        }

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
                store = StateStore(cfg.state_dir, cfg.device_index)
                Path(cfg.state_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
                self._lock(Path(cfg.state_dir) / f"gpu{cfg.device_index}.lock", f"state directory {cfg.state_dir}")
                self._restore(store)
                self._store = store  # only now may close() write a snapshot over the old one
            self._apply_configured_limits()
            self._bind(sock_path)
        except BaseException:
            self.close()
            raise
        self._poll_items = [(self._sock, zmq.POLLIN), (self._wake_r, zmq.POLLIN)]
        for pid in self.table.pids():
            self._watch_pid(pid)
        self._probe_device(force=True)
        log.info(
            "event=ready endpoint=%s device=%d uuid=%s total=%s budget=%s lease_s=%s state_dir=%s",
            cfg.endpoint,
            cfg.device_index,
            self.ledger.device.uuid,
            format_bytes(self.ledger.total_bytes),
            format_bytes(self.ledger.budget_bytes),
            cfg.lease_s,
            cfg.state_dir,
        )
        self.ready.set()

    def _apply_configured_limits(self) -> None:
        for instance, limit in self.config.limits.items():
            limits = self.ledger.set_limits(
                instance,
                max_bytes=None if limit.clear_max else limit.max_bytes,
                min_bytes=limit.min_bytes,
                weight=limit.weight,
            )
            log.info("event=limits source=config instance=%s %s", instance, _pairs(limits.to_dict()))

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
        if self._store is not None:
            try:
                self._commit()
                self._flush()
                self._write_snapshot()
            except Exception as exc:  # keep the journal; it is enough to recover
                log.error("event=snapshot_failed error=%s", exc)
            self._store.close()
            self._store = None
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
        self._pids.close()
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
            self._next_notify_s = self.clock() + 5.0
            self._notify_ready = True
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

    # ---------------------------------------------------------------- rounds
    def run_round(self, timeout_ms: int | None = None) -> None:
        if timeout_ms is None:
            timeout_ms = self._poll_timeout_ms()
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
        self._timers(now)
        self._commit()
        self._send(replies)
        if replies:
            # One sample per request: the round's service time (group commit makes it shared).
            self.counters.latency.observe(time.perf_counter() - started, len(replies))
        if self._snapshot_requests:
            self._answer_snapshots(now)

    def _dispatch(self, events: list[tuple[Any, int]], now: float, replies: list[tuple[bytes, bytes]]) -> None:
        for target, _ in events:
            if target is self._sock:
                self._read_requests(now, replies)
            elif target == self._wake_r:
                os.read(self._wake_r, 4096)
            else:
                self._pid_exited(target)

    def _answer_snapshots(self, now: float) -> None:
        requests, self._snapshot_requests = self._snapshot_requests, []
        status = self.status(now)
        for box in requests:
            box["status"] = status
            box["done"].set()

    def _poll_timeout_ms(self) -> int:
        return 100

    def _read_requests(self, now: float, replies: list[tuple[bytes, bytes]]) -> int:
        """Handle every request waiting (up to ``max_batch``); returns how many were read."""
        sock = self._sock
        assert sock is not None
        recv = sock.recv
        peers = self._peers
        counters = self.counters
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
            body = frame.bytes
            if extra:
                self.counters.bad_frames += 1
                replies.append((rid, proto.error_reply(None, "bad_request", "a request is exactly one frame")))
                continue
            reply = self._handle(rid, peer, body, now)
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
        if len(self._peers) >= 16384:
            bound = {b.routing_id for b in self.table}
            self._peers = {k: v for k, v in self._peers.items() if k in bound}
        self._peers[rid] = peer
        return peer

    def _handle(self, rid: bytes, peer: Peer, body: bytes, now: float) -> bytes | None:
        try:
            request = _decode_request(body)  # the socket's MAXMSGSIZE already bounds its size
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            self.counters.bad_frames += 1
            try:
                proto.decode_request(body)
            except proto.ProtocolError as exc:  # the full path, for its one-line reason and the id
                return proto.error_reply(exc.request_id, "bad_request", str(exc))
            return proto.error_reply(None, "bad_request", "invalid request")
        self._body = body  # what the reply cache fingerprints (see _answer)
        try:
            return self._handlers[type(request)](request, rid, peer, now)
        except _Retried as retried:
            return retried.reply
        except BrokerError as exc:
            self.counters.refused(exc.code)
            return proto.error_reply(request.id, exc.code, exc.message, exc.details)
        except Exception:
            log.exception("event=internal_error op=%s", type(request).__name__)
            return proto.error_reply(request.id, "internal", "internal broker error; the request was not applied")

    def _send(self, replies: list[tuple[bytes, bytes]]) -> None:
        sock = self._sock
        if sock is None:
            return
        if self._pushes:
            replies = replies + self._pushes
            self._pushes = []
        send = _raw_send.__get__(sock)
        for rid, reply in replies:
            try:
                send(rid, _SNDMORE_NOBLOCK)
                send(reply, _NOBLOCK)
            except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer left; EAGAIN: it is not reading
                log.debug("event=reply_dropped errno=%s", exc.errno)

    # ------------------------------------------------------------ handlers
    def _refusal_for_token(self, token: str, binding: Binding | None) -> BrokerError:
        """Why a request with ``token`` may not drive a session from its connection."""
        if binding is not None:
            return NotOwner(
                f"session {binding.session_id} is bound to another connection; its owner may resume it with hello",
                details={"session_id": binding.session_id, "resume": True},
            )
        if token in self.table.fenced:
            return SessionEvicted(
                f"session {self.table.fenced[token]} was evicted by an operator; its memory has been given away"
            )
        return UnknownSession("unknown session; open a new one with hello")

    def _session_request(self, request: Any, rid: bytes, now: float) -> tuple[Binding, Session]:
        """The caller's binding and ledger session, with its lease renewed.

        A retried request (an id this session has been answered for) raises :class:`_Retried`
        carrying that first answer, so it is never applied twice.
        """
        binding = self.table.by_token(request.session)
        if binding is None or binding.routing_id != rid:
            raise self._refusal_for_token(request.session, binding)
        if request.id in binding.replies or request.id <= binding.forgotten_id:
            cached = binding.replay(request.id, hash(self._body))
            if cached is not None:
                raise _Retried(cached)
        session = self.ledger.sessions[binding.session_id]
        session.last_seen_s = now
        if session.state is not _LIVE and self.ledger.touch(session.id, now):
            log.info("event=session_live session=%s detail=lease_renewed", session.id)
        reserve = getattr(request, "reserve_pages", None)
        if reserve is not None and reserve != session.reserve_pages:
            self.ledger.set_reserve_pages(session.id, reserve)
        return binding, session

    def _answer(self, binding: Binding, request_id: int, result: Any) -> bytes:
        reply = _encode(proto.Reply(id=request_id, ok=True, result=result))
        binding.remember_reply(request_id, hash(self._body), reply, self.table.reply_cache)
        return reply

    def _hello(self, req: proto.Hello, rid: bytes, peer: Peer, now: float) -> bytes:
        version = max((v for v in req.versions if v in proto.SUPPORTED_VERSIONS), default=None)
        if version is None:
            raise UnsupportedVersion(
                f"client speaks protocol {sorted(req.versions)}, broker speaks {list(proto.SUPPORTED_VERSIONS)}",
                details={"supported": list(proto.SUPPORTED_VERSIONS)},
            )
        if peer.pid_known and req.pid != peer.pid:
            raise NotOwner(f"hello claims pid {req.pid} but the connection belongs to pid {peer.pid}")
        device = self.ledger.device
        if req.device_uuid and req.device_uuid != device.uuid:
            raise WrongDevice(
                f"worker is on GPU {req.device_uuid} but this broker serves GPU {device.index} ({device.uuid})",
                details={"worker_uuid": req.device_uuid, "broker_uuid": device.uuid},
            )
        retried = self.table.by_nonce(req.nonce)
        if retried is not None and self._same_process(retried, peer):
            retried.routing_id = rid
            return proto.ok_reply(req.id, self._hello_result(retried, version, resumed=False))
        if req.resume is not None:
            binding = self.table.by_token(req.resume)
            if binding is None and req.resume in self.table.fenced:
                raise SessionEvicted(f"session {self.table.fenced[req.resume]} was evicted by an operator")
            if binding is not None:
                return self._resume(req, binding, rid, peer, now, version)
        return self._open(req, rid, peer, now, version)

    def _same_process(self, binding: Binding, peer: Peer) -> bool:
        if binding.pid_verified:
            return peer.pid == binding.pid
        return binding.uid is None or binding.uid == peer.uid

    def _resume(self, req: proto.Hello, binding: Binding, rid: bytes, peer: Peer, now: float, version: int) -> bytes:
        if not self._same_process(binding, peer):
            raise NotOwner(f"session {binding.session_id} belongs to another process; a token alone is not enough")
        binding.routing_id = rid
        binding.version = version
        self.table.rekey_nonce(binding, req.nonce)
        self._on_disk.pop(binding.session_id, None)  # its nonce changed: journal the whole record
        holdings = None
        if req.holdings is not None:
            h = req.holdings
            holdings = Claim(dict(h.pools), h.granted_pages, h.reserve_pages, dict(h.holds))
        restored = self.ledger.sessions[binding.session_id].restored
        session, adopted = self.ledger.resume(binding.session_id, now, holdings=holdings)
        if adopted:
            # The worker's books already show these requests (releases it booked before
            # sending); answer their retries from the cache instead of applying them again.
            result = {"granted_pages": session.granted_pages, "settled": True}
            for request_id in req.settled:
                binding.remember_reply(request_id, None, proto.ok_reply(request_id, result), self.table.reply_cache)
        elif restored and holdings is not None:
            log.warning(
                "event=resume_claims_refused session=%s instance=%s detail=growth_does_not_fit_kept_checkpoint",
                session.id, session.instance,
            )
        log.info(
            "event=session_resumed session=%s instance=%s pid=%d restored=%s adopted=%s reserved=%d granted_pages=%d",
            session.id,
            session.instance,
            session.pid,
            restored,
            adopted,
            session.reserved_bytes,
            session.granted_pages,
        )
        return proto.ok_reply(req.id, self._hello_result(binding, version, resumed=True))

    def _open(self, req: proto.Hello, rid: bytes, peer: Peer, now: float, version: int) -> bytes:
        cfg = self.config
        rate_key = peer.pid if peer.pid_known else (peer.uid, peer.address)
        if not self._hellos.allow(rate_key, now):
            raise RateLimited("too many hellos from this peer; retry shortly")
        if len(self.table) >= cfg.max_sessions:
            raise RateLimited(f"the broker already serves {cfg.max_sessions} sessions")
        if peer.pid_known and self.table.count_for_pid(peer.pid) >= cfg.max_sessions_per_pid:
            raise RateLimited(f"pid {peer.pid} already has {cfg.max_sessions_per_pid} sessions")
        if peer.uid is not None and self.table.count_for_uid(peer.uid) >= cfg.max_sessions_per_uid:
            raise RateLimited(f"uid {peer.uid} already has {cfg.max_sessions_per_uid} sessions")
        if req.page_bytes > self.ledger.total_bytes:
            raise BadRequest(f"page_bytes {req.page_bytes} is larger than the device ({self.ledger.total_bytes} bytes)")
        if req.holdings is not None and (req.holdings.pools or req.holdings.granted_pages):
            # Claims are a resume's business: a session this broker never knew starts empty,
            # and its worker asks again for what it holds, through admission like anyone.
            log.info("event=hello_claims_ignored instance=%s pid=%d resume=%s", req.instance, req.pid, req.resume is not None)
        session_id, token = self.table.new_ids()
        verified = peer.pid_known
        self.ledger.open_session(
            session_id,
            instance=req.instance,
            pid=req.pid,
            pid_verified=verified,
            tp_rank=req.tp_rank,
            tp_size=req.tp_size,
            page_bytes=req.page_bytes,
            now_s=now,
        )
        binding = Binding(
            session_id=session_id,
            token=token,
            nonce=req.nonce,
            pid=req.pid,
            pid_verified=verified,
            pid_start_ticks=process_start_ticks(req.pid) if verified else None,
            uid=peer.uid,
            version=version,
            client=req.client,
            adapter=None if req.adapter is None else msgspec.structs.asdict(req.adapter),
            routing_id=rid,
        )
        self.table.add(binding)
        if req.resume is not None and self.ledger.growth_hold is not None:
            self.ledger.sessions[session_id].reasserting = True  # its record was lost: let it ask again
        if req.limits is not None:
            self._limits_from_hello(req.instance, req.limits)
        if verified:
            self._watch_pid(req.pid)
        log.info(
            "event=session_open session=%s instance=%s pid=%d uid=%s verified=%s rank=%d tp_size=%d page_bytes=%d",
            session_id,
            req.instance,
            req.pid,
            peer.uid,
            verified,
            req.tp_rank,
            req.tp_size,
            req.page_bytes,
        )
        return proto.ok_reply(req.id, self._hello_result(binding, version, resumed=False))

    def _limits_from_hello(self, instance: str, asked: proto.LimitsRequest) -> None:
        """A worker's requested limits, clamped by admin policy: they apply only to an instance no
        admin or config has set limits for, and a floor is cut to what the other floors leave."""
        if self.ledger.limits.get(instance, Limits()).revision:
            log.info("event=hello_limits instance=%s outcome=ignored reason=set_by_admin", instance)
            return
        others = sum(l.min_bytes for name, l in self.ledger.limits.items() if name != instance)
        floor = KEEP
        if asked.min_bytes is not proto.UNSET:
            floor = max(0, min(asked.min_bytes, self.ledger.budget_bytes - others))
        try:
            limits = self.ledger.set_limits(
                instance,
                max_bytes=KEEP if asked.max_bytes is proto.UNSET else asked.max_bytes,
                min_bytes=floor,
                weight=KEEP if asked.weight is proto.UNSET else asked.weight,
            )
        except BrokerError as exc:
            log.info("event=hello_limits instance=%s outcome=refused reason=%r", instance, exc.message)
            return
        # Hello limits stay revision 0 "unset by admin", so a later hello may still adjust them.
        self.ledger.restore_limits(instance, Limits(limits.max_bytes, limits.min_bytes, limits.weight, 0))
        log.info("event=hello_limits instance=%s outcome=applied %s", instance, _pairs(limits.to_dict()))

    def _hello_result(self, binding: Binding, version: int, *, resumed: bool) -> dict[str, Any]:
        session = self.ledger.sessions[binding.session_id]
        device = self.ledger.device
        return {
            "session": binding.token,
            "session_id": binding.session_id,
            "version": version,
            "lease_s": self.config.lease_s,
            "heartbeat_s": self.config.lease_s / 4,
            "resumed": resumed,
            "pid_verified": binding.pid_verified,
            "device": {"index": device.index, "uuid": device.uuid, "name": device.name, "simulated": device.simulated},
            "limits": self.ledger.limits.get(session.instance, Limits()).to_dict(),
            "holdings": {
                "pools": dict(session.pools),
                "granted_pages": session.granted_pages,
                "reserve_pages": session.reserve_pages,
                "holds": dict(session.holds),
            },
        }

    def _reserve(self, req: proto.Reserve, rid: bytes, peer: Peer, now: float) -> bytes:
        binding, session = self._session_request(req, rid, now)
        if req.measured_base:
            self._probe_device(force=True)  # pin what the device says now, not a reading ago
        try:
            pools = self.ledger.reserve(
                session.id, dict(req.pools), None if req.usage is None else dict(req.usage),
                holds=None if req.holds is None else dict(req.holds), measured_base=req.measured_base,
            )
        except BrokerError as exc:
            log.info("event=refusal session=%s op=reserve code=%s detail=%r", binding.session_id, exc.code, exc.message)
            reply = proto.error_reply(req.id, exc.code, exc.message, exc.details)
            binding.remember_reply(req.id, hash(self._body), reply, self.table.reply_cache)
            self.counters.refused(exc.code)
            self._press_for(session.instance, int(exc.details.get("asked_bytes", 0)), exc, now)
            return reply
        return self._answer(binding, req.id, {
            "pools": pools, "holds": dict(session.holds), "reserved_bytes": session.reserved_bytes,
            "measured_bytes": self.ledger.measured_bytes(session.id),
        })

    def _acquire(self, req: proto.Acquire, rid: bytes, peer: Peer, now: float) -> bytes:
        binding, session = self._session_request(req, rid, now)
        grant = self.ledger.acquire(session.id, req.pages, req.min_pages)
        if req.caller_pages is not None:  # the client's reserve after this grant, as it books it
            _, reserve_after = split_grant(session.reserve_pages, grant.pages, req.caller_pages, req.caller_min_pages)
            self.ledger.set_reserve_pages(session.id, reserve_after)
        result: dict[str, Any] = {"granted": grant.pages, "granted_pages": session.granted_pages}
        if grant.refusal is not None:
            refusal = grant.refusal
            self.counters.refused(refusal.code)
            result["refused"] = {"code": refusal.code, "message": refusal.message, "details": refusal.details}
            floor_pages = req.pages if req.min_pages is None else max(1, req.min_pages)
            self._press_for(session.instance, floor_pages * session.page_bytes, refusal, now)
        else:
            self.counters.grants += 1
        return self._answer(binding, req.id, result)

    def _release(self, req: proto.Release, rid: bytes, peer: Peer, now: float) -> bytes:
        binding, session = self._session_request(req, rid, now)
        remaining = self.ledger.release(session.id, req.pages)
        if self.pressure.pending:
            self.pressure.on_release(session.id, req.pages)
        return self._answer(binding, req.id, {"granted_pages": remaining})

    def _heartbeat(self, req: proto.Heartbeat, rid: bytes, peer: Peer, now: float) -> bytes:
        binding, session = self._session_request(req, rid, now)
        return self._answer(binding, req.id, {"state": session.state.value, "granted_pages": session.granted_pages})

    def _close(self, req: proto.Close, rid: bytes, peer: Peer, now: float) -> bytes:
        binding, _ = self._session_request(req, rid, now)
        freed = self._end_session(binding, cause="closed")
        return proto.ok_reply(req.id, {"closed": binding.session_id, "freed_bytes": freed})

    def _status(self, req: proto.Status, rid: bytes, peer: Peer, now: float) -> bytes:
        if req.session is not None:
            try:
                self._session_request(req, rid, now)  # renews the lease; a status is never cached
            except _Retried:
                pass
        return proto.ok_reply(req.id, self.status(now))

    def _require_admin(self, peer: Peer, op: str) -> None:
        if not is_admin(peer, self.config.admin_group):
            who = f"uid {peer.uid}" if peer.uid is not None else f"remote peer {peer.address or '?'}"
            raise Forbidden(f"{op} is an admin operation; {who} is not root, the broker's user or in the admin group")

    def _set_limit(self, req: proto.SetLimit, rid: bytes, peer: Peer, now: float) -> bytes:
        self._require_admin(peer, "limit")
        limits = self.ledger.set_limits(
            req.instance,
            max_bytes=KEEP if req.max_bytes is proto.UNSET else req.max_bytes,
            min_bytes=KEEP if req.min_bytes is proto.UNSET else req.min_bytes,
            weight=KEEP if req.weight is proto.UNSET else req.weight,
            revision=req.revision,
        )
        log.info(
            "event=limits instance=%s max_bytes=%s min_bytes=%d weight=%s revision=%d uid=%s",
            req.instance,
            limits.max_bytes,
            limits.min_bytes,
            limits.weight,
            limits.revision,
            peer.uid,
        )
        return proto.ok_reply(req.id, {"instance": req.instance, **limits.to_dict()})

    def _evict(self, req: proto.Evict, rid: bytes, peer: Peer, now: float) -> bytes:
        self._require_admin(peer, "evict")
        binding = self.table.by_id(req.session_id)
        if binding is None:
            raise UnknownSession(f"no session {req.session_id} (see `kvcached-broker status` for ids)")
        if req.kill and binding.pid_verified and not _may_signal(peer, binding):
            raise Forbidden(
                f"uid {peer.uid} may not kill pid {binding.pid} (uid {binding.uid}); only root or its own user may. "
                "Nothing was evicted; evict without --kill, or ask root"
            )
        killed = False
        kill_error = None
        if req.kill:
            if not binding.pid_verified:
                kill_error = "pid not verified (remote or other pid namespace); not killed"
            else:
                try:
                    os.kill(binding.pid, signal.SIGKILL)
                    killed = True
                except OSError as exc:
                    kill_error = exc.strerror
        self.table.fence(binding)
        self._pending_records.append(FenceRecord(token=binding.token, session_id=binding.session_id))
        freed = self._end_session(binding, cause="evicted")
        result = {"evicted": binding.session_id, "freed_bytes": freed, "killed": killed}
        if kill_error:
            result["kill_error"] = kill_error
        return proto.ok_reply(req.id, result)

    def _simulate(self, req: proto.Simulate, rid: bytes, peer: Peer, now: float) -> bytes:
        self._require_admin(peer, "simulate")
        if not isinstance(self.probe, SimulatedDevice):
            raise BadRequest("simulate works only on a simulated device (serve --simulate SIZE)")
        if req.external_bytes is not proto.UNSET:
            self.probe.set_external(req.external_bytes)
        if req.process_bytes is not proto.UNSET:
            self.probe.set_process_bytes(dict(req.process_bytes))
        self._probe_device(force=True)
        return proto.ok_reply(req.id, {"external_bytes": self.ledger.external_bytes, "budget_bytes": self.ledger.budget_bytes})

    # --------------------------------------------------------------- pressure
    def _press_for(self, instance: str, asked_bytes: int, refusal: BrokerError, now: float) -> None:
        """A refused instance below its floor or fair share: ask those above theirs for pages."""
        if refusal.code != "budget_exceeded" or refusal.details.get("held"):
            return  # its own cap, external overcommit or a recovery hold: taking from others would not help
        need = asked_bytes - int(refusal.details.get("free_bytes", 0))
        for ask in self.pressure.plan(self.ledger, instance, need, now):
            binding = self.table.by_id(ask.session_id)
            if binding is None or binding.routing_id is None:
                continue
            push = proto.Pressure(session_id=ask.session_id, pages=ask.pages, reason=f"{instance} is below its share")
            self._pushes.append((binding.routing_id, proto.encode(push)))
            log.info(
                "event=pressure for=%s session=%s instance=%s pages=%d bytes=%d",
                instance, ask.session_id, ask.instance, ask.pages, ask.pages * ask.page_bytes,
            )

    # ------------------------------------------------------- session endings
    def _end_session(self, binding: Binding, cause: str) -> int:
        freed = self.ledger.sessions[binding.session_id].reported_bytes
        session = self.ledger.close_session(binding.session_id)
        self.pressure.on_close(binding.session_id)
        limits = self.ledger.limits.get(session.instance)
        if limits is not None and not limits.revision and session.instance not in self.ledger.instance_names():
            self.ledger.forget_limits(session.instance)  # asked for at hello: they leave with the instance
        self.table.remove(binding.session_id)
        if binding.pid_verified and not self.table.count_for_pid(binding.pid):
            self._unwatch_pid(binding.pid)
        self.counters.reclaimed(cause)
        log.info(
            "event=session_end cause=%s session=%s instance=%s pid=%d freed_bytes=%d",
            cause,
            session.id,
            session.instance,
            session.pid,
            freed,
        )
        return freed

    def _watch_pid(self, pid: int) -> None:
        try:
            fd = self._pids.watch(pid)
        except ProcessLookupError:
            self._reclaim_pid(pid)
            return
        except OSError as exc:
            log.warning("event=pidfd_unavailable pid=%d error=%s detail=lease_only", pid, exc.strerror)
            return
        if fd is not None:
            self._poll_items.append((fd, zmq.POLLIN))

    def _unwatch_pid(self, pid: int) -> None:
        fd = self._pids.unwatch(pid)
        if fd is not None:
            self._poll_items = [item for item in self._poll_items if item[0] != fd]

    def _pid_exited(self, fd: int) -> None:
        pid = self._pids.pid_of(fd)
        if pid is not None:
            self._reclaim_pid(pid)

    def _reclaim_pid(self, pid: int) -> None:
        for session_id in self.table.session_ids_of_pid(pid):
            binding = self.table.by_id(session_id)
            if binding is not None:
                self._end_session(binding, cause="exited")
        self._unwatch_pid(pid)

    # ---------------------------------------------------------------- timers
    def _timers(self, now: float) -> None:
        if now >= self._next_lease_check_s:
            self._next_lease_check_s = now + min(1.0, self.config.lease_s / 10)
            for session in self.ledger.expire_leases(now, self.config.lease_s):
                log.warning(
                    "event=session_stale session=%s instance=%s pid=%d idle_s=%.1f charged_bytes=%d",
                    session.id,
                    session.instance,
                    session.pid,
                    now - session.last_seen_s,
                    session.reported_bytes,
                )
        if now >= self._next_probe_s:
            self._probe_device()
        if self.ledger.growth_hold is not None and (now >= self._hold_until_s or not self._recovering()):
            log.warning("event=growth_hold_lifted recovering_sessions=%d", self._recovering())
            self.ledger.release_growth()
        if self._deferred and now >= self._defer_until_s:
            self._flush()
        if self.pressure.pending:
            for session_id, ask in self.pressure.expire(now):
                log.warning(
                    "event=pressure_ignored session=%s instance=%s outstanding_pages=%d detail=still_charged",
                    session_id, ask.instance, ask.outstanding_pages,
                )
        if self._notify_ready:
            if now >= self._next_notify_s:
                self._next_notify_s = now + 5.0
                self.notifier.status(self._summary())
            interval = self.notifier.watchdog_interval_s
            if interval and now >= self._next_watchdog_s:
                self._next_watchdog_s = now + interval
                self.notifier.watchdog()

    def _recovering(self) -> int:
        return sum(1 for s in self.ledger.sessions.values() if s.state is SessionState.RECOVERING)

    def _probe_device(self, force: bool = False) -> None:
        now = self.clock()
        self._next_probe_s = now + self.config.probe_interval_s
        try:
            reading = self.probe.read()
        except Exception as exc:
            log.error("event=device_read_failed error=%s", exc)
            return
        headroom = self._headroom_bytes
        if self._headroom_fraction is not None:
            headroom = int(reading.total_bytes * self._headroom_fraction)
        pids = [s.pid for s in self.ledger.sessions.values() if s.pid_verified]
        external = reading.external_for(pids, self.ledger.reserved_bytes + self.ledger.granted_bytes)
        measured = {pid: reading.process_bytes.get(pid, 0) for pid in pids}
        self.ledger.observe_device(
            total_bytes=reading.total_bytes,
            headroom_bytes=headroom,
            external_bytes=external,
            measured_by_pid=measured,
        )
        over = self.ledger.overcommitted
        if over != self._was_overcommitted:
            self._was_overcommitted = over
            log.warning(
                "event=%s charged=%d budget=%d external=%d",
                "overcommitted" if over else "back_under_budget",
                self.ledger.charged_bytes,
                self.ledger.budget_bytes,
                self.ledger.external_bytes,
            )

    # ----------------------------------------------------------- checkpoint
    def _commit(self) -> None:
        changes = self.ledger.drain_changes()
        if self._store is None:
            self._pending_records.clear()
            return
        if changes is None and not self._pending_records:
            return
        records = self._pending_records
        self._pending_records = []
        durable_now = bool(records)  # fences
        if changes is not None:
            durable_now |= changes.grew or bool(changes.closed or changes.limits)
            on_disk = self._on_disk
            sessions = self.ledger.sessions
            for session_id in changes.sessions:
                session = sessions[session_id]
                last = on_disk.get(session_id)
                if last is not None and last.still(session):
                    continue  # back to what the journal already says (say, one page out and back)
                holdings = Holdings.of(session)
                if session_id in on_disk:  # the rest of its record is already on disk
                    records.append(holdings.record(session_id))
                else:
                    records.append(self._session_record(session_id))
                    durable_now = True
                on_disk[session_id] = holdings
            for session_id in changes.closed:
                records.append(CloseRecord(session_id=session_id))
                on_disk.pop(session_id, None)
            for instance in changes.limits:
                limits = self.ledger.limits.get(instance)
                records.append(_limit_record(instance, limits) if limits else UnlimitRecord(instance=instance))
        if not records:
            return
        if not durable_now:
            # Only decreases (releases, a smaller reserve): losing them in a crash over-charges
            # until the worker re-asserts what it holds, which is safe, so they ride along with
            # the next durable write or go out within DEFER_S.
            if not self._deferred:
                self._defer_until_s = self.clock() + DEFER_S
            self._deferred.extend(records)
            return
        self._flush(records)

    def _flush(self, records: list[JournalRecord] | None = None) -> None:
        assert self._store is not None
        batch = self._deferred + (records or [])
        self._deferred = []
        if not batch:
            return
        self._store.append(batch)
        if self._store.needs_compaction():
            self._write_snapshot()

    def _write_snapshot(self) -> None:
        assert self._store is not None
        self._store.write_snapshot(self._snapshot_state())
        self._on_disk = dict.fromkeys(self.ledger.sessions)

    def _session_record(self, session_id: str) -> SessionRecord:
        s = self.ledger.sessions[session_id]
        b = self.table.by_id(session_id)
        assert b is not None
        return SessionRecord(
            id=s.id,
            token=b.token,
            nonce=b.nonce,
            instance=s.instance,
            pid=s.pid,
            pid_verified=s.pid_verified,
            pid_start_ticks=b.pid_start_ticks,
            uid=b.uid,
            rank=s.tp_rank,
            tp_size=s.tp_size,
            page_bytes=s.page_bytes,
            pools=dict(s.pools),
            granted_pages=s.granted_pages,
            reserve_pages=s.reserve_pages,
            usage=dict(s.usage),
            holds=dict(s.holds),
            client=b.client,
            adapter=None if b.adapter is None else proto.AdapterInfo(**b.adapter),
        )

    def _snapshot_state(self) -> Snapshot:
        return Snapshot(
            device_uuid=self.ledger.device.uuid,
            sessions=[self._session_record(sid) for sid in self.ledger.sessions],
            limits=[_limit_record(name, limits) for name, limits in self.ledger.limits.items()],
            fenced=[FenceRecord(token=token, session_id=sid) for token, sid in self.table.fenced.items()],
        )

    def _restore(self, store: StateStore) -> None:
        loaded = store.open()
        snap = loaded.snapshot
        records = loaded.records
        if snap is not None and snap.device_uuid != self.ledger.device.uuid:
            log.warning(
                "event=state_device_mismatch state_uuid=%s device_uuid=%s detail=state_ignored",
                snap.device_uuid,
                self.ledger.device.uuid,
            )
            snap, records = None, []
        sessions, limits, fenced = _replay(snap, records)
        for name, limit in limits.items():
            self.ledger.restore_limits(
                name, Limits(max_bytes=limit.max_bytes, min_bytes=limit.min_bytes, weight=limit.weight, revision=limit.revision)
            )
        for token, session_id in fenced.items():
            self.table.fenced[token] = session_id
        now = self.clock()
        kept = dropped = 0
        for record in sessions.values():
            if record.pid_verified and not process_alive(record.pid, record.pid_start_ticks):
                dropped += 1
                self.counters.reclaimed("exited_while_down")
                log.info(
                    "event=session_end cause=exited_while_down session=%s instance=%s pid=%d freed_bytes=%d",
                    record.id,
                    record.instance,
                    record.pid,
                    sum(record.pools.values()) + sum(record.holds.values()) + record.granted_pages * record.page_bytes,
                )
                continue
            self._restore_session(record, now)
            kept += 1
        if snap is not None or records:
            log.info("event=recovered sessions=%d dropped=%d torn_bytes=%d", kept, dropped, loaded.torn_bytes)
        self._distrust_if_damaged(loaded, now)
        self.ledger.drain_changes()
        store.write_snapshot(self._snapshot_state())
        self._on_disk = dict.fromkeys(self.ledger.sessions)

    def _distrust_if_damaged(self, loaded: LoadedState, now: float) -> None:
        """Damaged or cut-short state may under-count what the restored sessions hold: until
        their workers have re-asserted it (or a lease has passed), nobody else may grow."""
        if not (loaded.damaged or loaded.torn_bytes):
            return
        self.state_damage = {
            "damaged_records": loaded.damaged_records,
            "damaged_bytes": loaded.damaged_bytes,
            "torn_bytes": loaded.torn_bytes,
            "snapshot": loaded.snapshot_damage,
        }
        log.warning(
            "event=state_damaged damaged_records=%d damaged_bytes=%d torn_bytes=%d snapshot=%r "
            "detail=growth_held_until_restored_sessions_reassert_or_%.0fs",
            loaded.damaged_records, loaded.damaged_bytes, loaded.torn_bytes, loaded.snapshot_damage,
            self._hold_s(),
        )
        self.ledger.hold_growth("the broker restarted from damaged state and waits for its workers to re-assert what they hold")
        self._hold_until_s = now + self._hold_s()

    def _hold_s(self) -> float:
        return 2 * self.config.lease_s

    def _restore_session(self, record: SessionRecord, now: float) -> None:
        self.ledger.open_session(
            record.id,
            instance=record.instance,
            pid=record.pid,
            pid_verified=record.pid_verified,
            tp_rank=record.rank,
            tp_size=record.tp_size,
            page_bytes=record.page_bytes,
            now_s=now,
            pools=dict(record.pools),
            granted_pages=record.granted_pages,
            reserve_pages=record.reserve_pages,
            state=SessionState.RECOVERING,
            restored=True,
            holds=dict(record.holds),
        )
        self.ledger.sessions[record.id].usage = dict(record.usage)
        self.table.add(
            Binding(
                session_id=record.id,
                token=record.token,
                nonce=record.nonce,
                pid=record.pid,
                pid_verified=record.pid_verified,
                pid_start_ticks=record.pid_start_ticks,
                uid=record.uid,
                version=proto.PROTOCOL_VERSION,
                client=record.client,
                adapter=None if record.adapter is None else msgspec.structs.asdict(record.adapter),
            )
        )

    # ---------------------------------------------------------------- status
    def status(self, now: float | None = None) -> dict[str, Any]:
        now = self.clock() if now is None else now
        from .. import broker as _pkg

        broker_meta = {
            "version": _pkg.__version__,
            "pid": os.getpid(),
            "endpoint": self.config.endpoint,
            "protocol": proto.PROTOCOL_VERSION,
            "uptime_s": round(now - self._started_s, 3),
            "lease_s": self.config.lease_s,
            "state_dir": str(self.config.state_dir) if self.config.state_dir else None,
            "recovering_sessions": self._recovering(),
            "state_damage": self.state_damage,
            "growth_held": self.ledger.growth_hold,
            "counters": self.counters.to_dict(),
        }
        shares = fair_shares(self.ledger)

        def policy_view(instance: str) -> dict[str, Any]:
            return {"fair_share_bytes": shares.get(instance, 0), "pressure": self.pressure.instance_view(instance)}

        return build_status(self.ledger, self.table, broker_meta, now, policy_view)


def _may_signal(peer: Peer, binding: Binding) -> bool:
    """Whether the admin could send a signal to the session's process itself (kill(2)'s rule,
    without capabilities): root, or the same user."""
    return peer.uid == 0 or (peer.uid is not None and peer.uid == binding.uid)


def _limit_record(instance: str, limits: Limits) -> LimitRecord:
    return LimitRecord(instance=instance, max_bytes=limits.max_bytes, min_bytes=limits.min_bytes,
                       weight=limits.weight, revision=limits.revision)


def _replay(
    snap: Snapshot | None, records: list[JournalRecord]
) -> tuple[dict[str, SessionRecord], dict[str, LimitRecord], dict[str, str]]:
    """Sessions, limits and fences after applying the journal's records to the snapshot."""
    sessions = {r.id: r for r in snap.sessions} if snap else {}
    limits = {r.instance: r for r in snap.limits} if snap else {}
    fenced = {r.token: r.session_id for r in snap.fenced} if snap else {}
    for record in records:
        if isinstance(record, SessionRecord):
            sessions[record.id] = record
        elif isinstance(record, HoldRecord):
            known = sessions.get(record.session_id)
            if known is not None:
                sessions[record.session_id] = msgspec.structs.replace(
                    known, pools=record.pools, granted_pages=record.granted_pages,
                    reserve_pages=record.reserve_pages, usage=record.usage, holds=record.holds,
                )
        elif isinstance(record, CloseRecord):
            sessions.pop(record.session_id, None)
        elif isinstance(record, LimitRecord):
            limits[record.instance] = record
        elif isinstance(record, UnlimitRecord):
            limits.pop(record.instance, None)
        elif isinstance(record, FenceRecord):
            fenced[record.token] = record.session_id
    return sessions, limits, fenced


def _pairs(values: dict[str, Any]) -> str:
    return " ".join(f"{key}={value}" for key, value in values.items())
