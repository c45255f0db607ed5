"""Wake-ups between the processes of one engine: a doorbell per process, rung by pid.

Board writes (:mod:`.board`) are plain memory; a doorbell tells the other side to look.  Each
process that takes part binds one abstract-namespace Unix datagram socket named after its pid
(no file to clean up, gone with the process; close-on-exec, and closed in a forked child, so
no other process keeps it bound).  :func:`ring` sends one byte to a pid's doorbell
and never blocks or raises: a peer that is gone, or whose queue is full, simply is not woken
(every reader also wakes on its own bounded timeout).  A ring wakes the governors' thread
(:func:`runner.wake`) and anyone in :func:`wait`.
"""

from __future__ import annotations

import os
import socket
import threading

from .. import announce
from . import runner

log = announce.logger("kvcached_broker.adapters")

PREFIX = "\0kvcached-broker-doorbell-"

_lock = threading.Lock()
_cond = threading.Condition()
_rings = 0
_bound_pid = 0
_server: socket.socket | None = None
_sender: socket.socket | None = None


def address(pid: int) -> str:
    return f"{PREFIX}{pid}"


def start() -> bool:
    """Bind this process's doorbell and serve it (idempotent; again after a fork); False if it cannot."""
    global _bound_pid, _server
    with _lock:
        if _bound_pid == os.getpid():
            return True
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(address(os.getpid()))
        except OSError as exc:
            sock.close()
            log.warning("event=kvcached_doorbell_unavailable error=%r detail=peers_poll_instead", str(exc))
            return False
        _bound_pid = os.getpid()
        _server = sock
    threading.Thread(target=_serve, args=(sock,), name="kvcached-broker-doorbell", daemon=True).start()
    return True


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
    global _lock, _cond, _rings, _bound_pid, _server, _sender
    for sock in (_server, _sender):
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass
    _lock, _cond = threading.Lock(), threading.Condition()
    _rings, _bound_pid, _server, _sender = 0, 0, None, None


os.register_at_fork(after_in_child=_close_in_child)


def ring(pid: int) -> None:
    """Wake process ``pid`` (its doorbell, if it has one).  Never blocks, never raises."""
    global _sender
    if pid <= 0:
        return
    try:
        with _lock:
            if _sender is None:
                _sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                _sender.setblocking(False)
            _sender.sendto(b"!", address(pid))
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
