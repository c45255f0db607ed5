"""One DEALER socket to one broker: send a request, wait for the reply with its id.

Requests are retried with the same bytes (so the same id) after each attempt times out;
the broker's reply cache makes that safe.  After ``timeout_s`` in all,
:class:`BrokerUnavailable` is raised.  Pushes from the broker (``pressure``) that arrive while
waiting are kept in :attr:`SyncTransport.pushes` for the caller.

A socket is not thread-safe: callers serialise use of one transport (the sync client holds a
lock around it).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import msgspec
import zmq
import zmq.asyncio
import zmq.backend

from . import protocol as proto
from .endpoint import ipc_path
from .errors import BrokerUnavailable

if TYPE_CHECKING:
    import asyncio  # imported when an AsyncTransport is made, not by every sync client


#: The compiled send underneath pyzmq's Python wrapper, which only adds routing_id/group
#: handling that DEALER sockets never use (docs/performance.md has what it saves).
_raw_send = zmq.backend.Socket.send
_NOBLOCK = int(zmq.NOBLOCK)


@dataclass(frozen=True)
class Timeouts:
    """``attempt_s``: wait for one reply before resending; ``total_s``: give up after this."""

    attempt_s: float = 1.0
    total_s: float = 10.0

    @classmethod
    def from_env(cls, total_s: float | None = None) -> "Timeouts":
        """``total_s``, else ``KVCACHED_BROKER_TIMEOUT_S``, else 10 s: a positive, finite number
        (anything else is one :class:`BrokerUnavailable` line naming where it came from)."""
        if total_s is None:
            raw = os.environ.get("KVCACHED_BROKER_TIMEOUT_S", "")
            try:
                total_s = float(raw) if raw else 10.0
            except ValueError:
                total_s = math.nan
            if not 0 < total_s < math.inf:
                raise BrokerUnavailable(
                    f"KVCACHED_BROKER_TIMEOUT_S={raw[:40]!r} is not a positive number of seconds")
        if not 0 < total_s < math.inf:
            raise BrokerUnavailable(f"the broker timeout must be a positive number of seconds, got {total_s}")
        return cls(attempt_s=min(1.0, total_s), total_s=total_s)


ENV_CURVE_SERVER = "KVCACHED_BROKER_CURVE_SERVER"
ENV_CURVE_CLIENT = "KVCACHED_BROKER_CURVE_CLIENT"


@dataclass(frozen=True)
class CurveKeys:
    """CURVE keys (z85 bytes) for a tcp endpoint: the broker's public key and this client's pair."""

    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def from_files(cls, server_key_file: str, client_secret_file: str) -> "CurveKeys":
        import zmq.auth

        try:
            server_public, _ = zmq.auth.load_certificate(server_key_file)
            public, secret = zmq.auth.load_certificate(client_secret_file)
        except (OSError, ValueError) as exc:
            raise BrokerUnavailable(f"cannot load CURVE keys: {exc}") from None
        if secret is None:
            raise BrokerUnavailable(f"{client_secret_file} holds no secret key (use the .key_secret file)")
        return cls(server_public, public, secret)

    @classmethod
    def from_env(cls, endpoint: str) -> "CurveKeys | None":
        """Keys named by ``KVCACHED_BROKER_CURVE_SERVER``/``_CLIENT``, for tcp endpoints only."""
        server, client = os.environ.get(ENV_CURVE_SERVER), os.environ.get(ENV_CURVE_CLIENT)
        if not endpoint.startswith("tcp://") or not (server or client):
            return None
        if not (server and client):
            raise BrokerUnavailable(f"set both {ENV_CURVE_SERVER} and {ENV_CURVE_CLIENT} for a CURVE endpoint")
        return cls.from_files(server, client)


def _configure(sock: zmq.Socket[Any], attempt_s: float, curve: CurveKeys | None) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.RECONNECT_IVL, 50)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    sock.setsockopt(zmq.RCVTIMEO, max(1, int(attempt_s * 1000)))
    if curve is not None:
        sock.curve_serverkey = curve.server_public
        sock.curve_publickey = curve.public
        sock.curve_secretkey = curve.secret


def _unreachable(endpoint: str, timeouts: Timeouts, why: str = "") -> BrokerUnavailable:
    detail = f": {why}" if why else ""
    return BrokerUnavailable(
        f"kvcached-broker at {endpoint} did not answer within {timeouts.total_s:g}s{detail}",
        details={"endpoint": endpoint},
    )


def socket_missing(endpoint: str) -> bool:
    path = ipc_path(endpoint)
    if path is None:
        return False
    try:
        return not path.exists()
    except PermissionError:
        raise BrokerUnavailable(
            f"permission denied on {path}: this user may not use the broker's socket (see serve --socket-group)",
            details={"endpoint": endpoint},
        ) from None


class SyncTransport:
    def __init__(self, endpoint: str, timeouts: Timeouts, *, curve: CurveKeys | None = None):
        self.endpoint = endpoint
        self.timeouts = timeouts
        self.pushes: list[proto.Pressure] = []
        curve = curve or CurveKeys.from_env(endpoint)
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        _configure(self._sock, timeouts.attempt_s, curve)
        self._recv_timeout_ms = max(1, int(timeouts.attempt_s * 1000))
        self._sock.connect(endpoint)

    def request(self, payload: bytes, request_id: int, *, total_s: float | None = None) -> proto.Reply:
        """The reply to ``request_id``; :class:`BrokerUnavailable` when none comes in time or the
        socket fails (a ZeroMQ error other than a timeout)."""
        try:
            return self._request(payload, request_id, total_s)
        except zmq.ZMQError as exc:
            raise BrokerUnavailable(f"kvcached-broker at {self.endpoint}: the socket failed ({exc})",
                                    details={"endpoint": self.endpoint}) from exc

    def _request(self, payload: bytes, request_id: int, total_s: float | None) -> proto.Reply:
        timeouts = self.timeouts if total_s is None else Timeouts(min(self.timeouts.attempt_s, total_s), total_s)
        deadline = time.monotonic() + timeouts.total_s
        sock = self._sock
        while True:
            if not self._send(payload, deadline):
                raise _unreachable(self.endpoint, timeouts, self._why_unreachable())
            attempt_start = time.monotonic()
            attempt_end = min(deadline, attempt_start + timeouts.attempt_s)
            self._set_recv_timeout(attempt_end - attempt_start, timeouts.attempt_s)
            while True:
                try:
                    frame = sock.recv()
                except zmq.Again:
                    if time.monotonic() >= attempt_end:
                        break
                    continue
                message = _decode(frame)
                if isinstance(message, proto.Reply):
                    if message.id == request_id:
                        return message
                elif message is not None:
                    self.pushes.append(message)
                if time.monotonic() >= attempt_end:
                    break
            if time.monotonic() >= deadline:
                raise _unreachable(self.endpoint, timeouts, self._why_unreachable())

    def _set_recv_timeout(self, seconds: float, attempt_s: float) -> None:
        # Whole attempts use one fixed value, so the hot path makes no setsockopt call.
        timeout_ms = int(attempt_s * 1000) if seconds >= attempt_s - 0.01 else max(1, int(seconds * 1000))
        if timeout_ms != self._recv_timeout_ms:
            self._sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
            self._recv_timeout_ms = timeout_ms

    def _send(self, payload: bytes, deadline: float) -> bool:
        """Queue ``payload``; False if no connection came up before ``deadline``."""
        while True:
            try:
                _raw_send(self._sock, payload, _NOBLOCK)
                return True
            except zmq.Again:  # IMMEDIATE: not connected (yet); wait for the pipe
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                if remaining_ms <= 0:
                    return False
                self._sock.poll(min(remaining_ms, 50), zmq.POLLOUT)

    def _why_unreachable(self) -> str:
        return "no socket file (is the broker running?)" if socket_missing(self.endpoint) else ""

    def drain(self) -> None:
        """Read whatever is waiting (pushes, late replies) without blocking."""
        events = self._sock.get(zmq.EVENTS)
        if isinstance(events, int) and not events & zmq.POLLIN:
            return  # cheaper than a receive that fails (docs/performance.md)
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            message = _decode(frame)
            if isinstance(message, proto.Pressure):
                self.pushes.append(message)

    def close(self) -> None:
        self._sock.close(0)


class AsyncTransport:
    """The asyncio twin: many requests in flight, matched to their replies by id."""

    def __init__(self, endpoint: str, timeouts: Timeouts, *, curve: CurveKeys | None = None):
        import asyncio

        self.endpoint = endpoint
        self.timeouts = timeouts
        self._asyncio = asyncio
        curve = curve or CurveKeys.from_env(endpoint)
        self._sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        _configure(self._sock, timeouts.attempt_s, curve)
        self._sock.setsockopt(zmq.RCVTIMEO, -1)
        self._sock.setsockopt(zmq.IMMEDIATE, 0)
        self._sock.connect(endpoint)
        self._waiting: dict[int, Any] = {}
        self._reader: asyncio.Task[None] | None = None
        self.on_push: Callable[[proto.Pressure], None] | None = None

    def _ensure_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = self._asyncio.get_running_loop().create_task(self._read_loop())

    async def _read_loop(self) -> None:
        while True:
            try:
                frame = await self._sock.recv()
            except (zmq.ZMQError, self._asyncio.CancelledError):
                return
            message = _decode(frame)
            if isinstance(message, proto.Reply):
                future = self._waiting.pop(message.id, None) if message.id is not None else None
                if future is not None and not future.done():
                    future.set_result(message)
            elif message is not None and self.on_push is not None:
                self.on_push(message)

    async def request(self, payload: bytes, request_id: int, *, total_s: float | None = None) -> proto.Reply:
        timeouts = self.timeouts if total_s is None else Timeouts(min(self.timeouts.attempt_s, total_s), total_s)
        self._ensure_reader()
        loop = self._asyncio.get_running_loop()
        deadline = loop.time() + timeouts.total_s
        future = loop.create_future()
        self._waiting[request_id] = future
        try:
            while True:
                await self._sock.send(payload)
                remaining = deadline - loop.time()
                try:
                    return await self._asyncio.wait_for(
                        self._asyncio.shield(future), timeout=min(timeouts.attempt_s, max(0.0, remaining))
                    )
                except self._asyncio.TimeoutError:
                    if loop.time() >= deadline:
                        why = "no socket file (is the broker running?)" if socket_missing(self.endpoint) else ""
                        raise _unreachable(self.endpoint, timeouts, why) from None
        finally:
            self._waiting.pop(request_id, None)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._sock.close(0)


def _decode(frame: bytes) -> proto.Reply | proto.Pressure | None:
    try:
        return proto.decode_broker_message(frame)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
