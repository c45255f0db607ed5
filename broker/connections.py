"""Who may hold the broker's file descriptors: the open-file limit, and bounds on connections.

libzmq accepts every connection on the listening socket as soon as it arrives, and aborts the
process when ``accept()`` fails with ``EMFILE`` (``Too many open files (src/ipc_listener.cpp)``,
SIGABRT: libzmq 4.3's ipc listener treats it as a bug).  No handshake is needed, so any member
of the socket group could abort the broker with about as many plain connections as the soft
open-file limit (1,024 by default).  libzmq has no option that bounds accepted connections (its
listen backlog only bounds those not yet accepted), so the broker bounds them itself:

* :func:`raise_open_files_limit` raises the soft ``RLIMIT_NOFILE`` to the hard limit at start
  (the systemd unit sets ``LimitNOFILE=``);
* :class:`ConnectionBook` (no I/O) decides whether an accepted connection may stay: at most
  ``max_total`` in all, and ``max_per_peer`` per peer (its uid over ipc, from ``SO_PEERCRED``;
  its address over tcp), so that one member of the socket group cannot take every slot;
* :class:`ConnectionMonitor` (a thread) reads libzmq's socket-monitor events, which carry each
  connection's fd (``ACCEPTED`` and ``DISCONNECTED``), asks the book, and shuts a refused
  connection's socket down, upon which libzmq closes it.

Invariant: ``max_total`` stays at most half of what the open-file limit leaves after a reserve
(:func:`connection_bounds`), so the connections libzmq accepts in the moment before the monitor
refuses them have the other half to use, with the pidfds, the state files and libzmq's own.
"""

from __future__ import annotations

import logging
import resource
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any, Hashable, Mapping, Sequence

import zmq
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("kvcached_broker")

_PEERCRED = struct.Struct("3i")  # pid, uid, gid
_POLL_MS = 200


@dataclass(frozen=True)
class OpenFiles:
    """``RLIMIT_NOFILE``: the soft limit found at start, and the soft and hard limits after."""

    soft_at_start: int
    soft: int
    hard: int

    def to_dict(self) -> dict[str, int]:
        return {"soft": self.soft, "hard": self.hard, "soft_at_start": self.soft_at_start}


def raise_open_files_limit() -> OpenFiles:
    """Raise the soft open-file limit to the hard one (an unlimited hard limit: to 1,048,576)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:  # e.g. above fs.nr_open
            log.warning("event=open_files_limit_not_raised soft=%d hard=%d error=%s", soft, hard, exc)
    now_soft, now_hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return OpenFiles(soft, _finite(now_soft), _finite(now_hard))


def _finite(limit: int) -> int:
    return 1 << 20 if limit == resource.RLIM_INFINITY else limit


@dataclass(frozen=True)
class ConnectionBounds:
    max_total: int
    max_per_peer: int
    #: What the open-file limit alone would allow (``max_total`` is at most this).
    fd_room: int


def connection_bounds(open_files: int, max_total: int, max_per_peer: int) -> ConnectionBounds:
    """The bounds in force: the configured ones, within half of what ``open_files`` leaves
    after a reserve for the broker's other descriptors (pidfds, state files, libzmq's, the
    metrics pool), at least 16."""
    reserve = min(256, open_files // 4)
    fd_room = max(16, (open_files - reserve) // 2)
    total = max(1, min(max_total, fd_room))
    return ConnectionBounds(max_total=total, max_per_peer=max(1, min(max_per_peer, total)), fd_room=fd_room)


class ConnectionBook:
    """Open connections by fd and by peer, and the decision to keep or refuse each (no I/O).

    A refused connection is open until its ``closed`` comes, but takes no slot: only admitted
    connections count against the bounds."""

    def __init__(self, bounds: ConnectionBounds):
        self.bounds = bounds
        self._open: dict[int, tuple[Hashable, bool]] = {}  # fd -> (peer, admitted)
        self._admitted_by_peer: dict[Hashable, int] = {}
        self.admitted = 0
        self.accepted_total = 0
        self.refused: dict[str, int] = {"total": 0, "per_peer": 0}

    def accepted(self, fd: int, peer: Hashable) -> str | None:
        """Book a connection libzmq accepted; returns why it must be refused, or None."""
        self.closed(fd)  # a DISCONNECTED that never came for an fd number now reused
        self.accepted_total += 1
        reason = None
        if self.admitted >= self.bounds.max_total:
            reason = "total"
        elif self._admitted_by_peer.get(peer, 0) >= self.bounds.max_per_peer:
            reason = "per_peer"
        if reason is not None:
            self.refused[reason] += 1
            self._open[fd] = (peer, False)
            return reason
        self._open[fd] = (peer, True)
        self.admitted += 1
        self._admitted_by_peer[peer] = self._admitted_by_peer.get(peer, 0) + 1
        return None

    def closed(self, fd: int) -> None:
        entry = self._open.pop(fd, None)
        if entry is None or not entry[1]:
            return
        peer = entry[0]
        self.admitted -= 1
        left = self._admitted_by_peer.get(peer, 1) - 1
        if left > 0:
            self._admitted_by_peer[peer] = left
        else:
            self._admitted_by_peer.pop(peer, None)

    def view(self) -> dict[str, Any]:
        return {
            "open": len(self._open),
            "admitted": self.admitted,
            "max": self.bounds.max_total,
            "max_per_peer": self.bounds.max_per_peer,
            "accepted": self.accepted_total,
            "refused": dict(self.refused),
        }


def peer_of(fd: int) -> Hashable:
    """Who is at the other end of connection ``fd``: ``("uid", N)`` over a unix socket,
    ``("addr", ip)`` over tcp, None if the fd is no longer a socket."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if sock.family == socket.AF_UNIX:
            _pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            return ("uid", uid)
        return ("addr", sock.getpeername()[0])
    except OSError:
        return None
    finally:
        sock.detach()


def shut_down(fd: int) -> bool:
    """Shut connection ``fd`` down (libzmq then sees it end and closes it); False if it is gone."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.detach()


class ConnectionMonitor:
    """Keeps the connections of ``sock`` within ``book``'s bounds, from a thread of its own.

    Create it before ``sock`` binds, so that it sees every connection."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], sock: zmq.Socket[bytes], book: ConnectionBook):
        self.book = book
        self._lock = threading.Lock()
        address = f"inproc://kvcached-broker-monitor-{id(self):x}"
        sock.monitor(address, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._events = ctx.socket(zmq.PAIR)
        self._events.setsockopt(zmq.RCVHWM, 0)  # an event lost would leave a count wrong for good
        self._events.setsockopt(zmq.LINGER, 0)
        self._events.connect(address)
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="kvcached-broker-connections", daemon=True)
        self._thread.start()

    def view(self) -> dict[str, Any]:
        with self._lock:
            return self.book.view()

    def close(self) -> None:
        self._closing = True
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        events = self._events
        try:
            while not self._closing:
                if not events.poll(_POLL_MS):
                    continue
                batch = []
                while True:  # every event waiting: a fd closed later in the batch is not cut
                    try:
                        batch.append(parse_monitor_message(events.recv_multipart(zmq.NOBLOCK)))
                    except zmq.Again:
                        break
                self._apply(batch)
        except zmq.ZMQError as exc:  # the context is ending
            if not self._closing:
                log.error("event=connection_monitor_failed error=%s", exc)
        finally:
            events.close(0)

    def _apply(self, batch: Sequence[Mapping[str, Any]]) -> None:
        refuse: dict[int, str] = {}
        for event in batch:
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                peer = peer_of(fd)
                with self._lock:
                    reason = self.book.accepted(fd, peer)
                if reason is not None:
                    refuse[fd] = reason
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                with self._lock:
                    self.book.closed(fd)
                refuse.pop(fd, None)
        for fd, reason in refuse.items():
            shut_down(fd)
            refused = sum(self.book.refused.values())
            if refused & (refused - 1) == 0 or refused % 1024 == 0:  # 1, 2, 4, ... then every 1,024th
                log.warning("event=connection_refused reason=%s refused_total=%d admitted=%d max=%d max_per_peer=%d",
                            reason, refused, self.book.admitted, self.book.bounds.max_total,
                            self.book.bounds.max_per_peer)
