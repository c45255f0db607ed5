"""Wake-ups between the processes of one engine: a doorbell per process, named on the board.

Board writes (:mod:`.board`) are plain memory; a doorbell tells the other side to look.  Each
process that takes part binds one abstract-namespace Unix datagram socket (no file to clean up,
gone with the process; close-on-exec, and closed in a forked child, so no other process keeps
it bound) named ``kvcached-broker-doorbell-<pid namespace>-<pid>-<token>``, where the token is
64 random bits drawn at bind time (drawn again if the name is taken).  Abstract sockets belong to
the network namespace, which processes of different PID namespaces may share (the same pid
there names different processes), so a name made of the pid alone could collide or be taken
first by someone else; this one cannot be guessed, and the board publishes it: every record
carries its writer's PID namespace, pid and token (:func:`start` returns the token).
:func:`ring` sends one byte to such a name and never blocks or raises: a peer that is gone, or
whose queue is full, simply is not woken (every reader also wakes on its own bounded timeout).
A ring wakes the governors' thread (:func:`runner.wake`) and anyone in :func:`wait`.  A ring
carries nothing: anyone who learns a name can only wake its process early.
"""

from __future__ import annotations

import errno
import os
import socket
import threading

from .. import announce
from . import liveness, runner
from .liveness import ProcessIdentity

log = announce.logger("kvcached_broker.adapters")

PREFIX = "\0kvcached-broker-doorbell-"

_lock = threading.Lock()
_cond = threading.Condition()
_rings = 0
_bound_pid = 0
_token = 0
_server: socket.socket | None = None
_sender: socket.socket | None = None
#: Tokens drawn before giving up on binding (each a fresh 64-bit draw: only a name taken on
#: purpose, or a broken network namespace, ever fails one).
BIND_ATTEMPTS = 8


def address(who: ProcessIdentity, token: int) -> str:
    """The doorbell of process ``who`` whose record publishes ``token``."""
    return f"{PREFIX}{who.pidns}-{who.pid}-{token:016x}"


def start() -> int:
    """Bind this process's doorbell and serve it (idempotent; again after a fork): its token, as
    records publish it, or 0 if it cannot (peers then poll)."""
    global _bound_pid, _server, _token
    with _lock:
        if _bound_pid == os.getpid():
            return _token
        bound = _bind(liveness.own())
        if bound is None:
            return 0
        sock, drawn = bound
        _bound_pid, _server, _token = os.getpid(), sock, drawn
    threading.Thread(target=_serve, args=(sock,), name="kvcached-broker-doorbell", daemon=True).start()
    return drawn


def _bind(me: ProcessIdentity) -> "tuple[socket.socket, int] | None":
    """A socket bound to a fresh doorbell name of ``me``, and its token; None (one warning) if
    no name could be bound."""
    error: OSError | None = None
    for _ in range(BIND_ATTEMPTS):
        drawn = int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1) or 1
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(address(me, drawn))
            return sock, drawn
        except OSError as exc:
            sock.close()
            error = exc
            if exc.errno != errno.EADDRINUSE:
                break
    log.warning("event=kvcached_doorbell_unavailable error=%r detail=peers_poll_instead", str(error))
    return None


def token() -> int:
    """This process's doorbell token (0: none bound yet)."""
    with _lock:
        return _token if _bound_pid == os.getpid() else 0


def _serve(sock: socket.socket) -> None:
    global _rings
    while True:
        try:
            sock.recv(64)
        except OSError:
            return
        with _cond:
            _rings += 1
            _cond.notify_all()
        runner.wake()


def _close_in_child() -> None:
    """After a fork: the child's copies of the parent's doorbell and sender are closed (the child
    neither serves the parent's doorbell nor keeps it bound once the parent is gone); the child
    binds its own on its first :func:`start`."""
    global _lock, _cond, _rings, _bound_pid, _server, _sender, _token
    for sock in (_server, _sender):
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass
    _lock, _cond = threading.Lock(), threading.Condition()
    _rings, _bound_pid, _server, _sender, _token = 0, 0, None, None, 0


os.register_at_fork(after_in_child=_close_in_child)


def ring(who: ProcessIdentity, token: int) -> None:
    """Wake process ``who`` at the doorbell its record publishes (``token`` 0: it has none).
    Never blocks, never raises."""
    global _sender
    if who.pid <= 0 or token <= 0:
        return
    try:
        with _lock:
            if _sender is None:
                _sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                _sender.setblocking(False)
            _sender.sendto(b"!", address(who, token))
    except OSError:
        pass  # gone, not listening, or its queue is full: it wakes on its own timeout


def rings() -> int:
    """How many rings this process has heard (pass it to :func:`wait`)."""
    with _cond:
        return _rings


def wait(seen: int, timeout_s: float) -> int:
    """Wait until a ring after ``seen`` arrives, or ``timeout_s``; the ring count now."""
    with _cond:
        _cond.wait_for(lambda: _rings > seen, timeout=timeout_s)
        return _rings
