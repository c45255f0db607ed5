"""Wake-ups between the processes of one engine: a doorbell per process, rung by pid.

Board writes (:mod:`.board`) are plain memory; a doorbell tells the other side to look.  Each
process that takes part binds one abstract-namespace Unix datagram socket named after its pid
(no file to clean up, gone with the process).  :func:`ring` sends one byte to a pid's doorbell
and never blocks or raises: a peer that is gone, or whose queue is full, simply is not woken
(every reader also wakes on its own bounded timeout).  A ring wakes the governors' thread
(:func:`runner.wake`) and anyone in :func:`wait`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

from . import runner

log = logging.getLogger("kvcached_broker.adapters")

PREFIX = "\0kvcached-broker-doorbell-"

_lock = threading.Lock()
_cond = threading.Condition()
_rings = 0
_bound_pid = 0
_sender: socket.socket | None = None


def address(pid: int) -> str:
    return f"{PREFIX}{pid}"


def start() -> bool:
    """Bind this process's doorbell and serve it (idempotent; again after a fork); False if it cannot."""
    global _bound_pid
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
