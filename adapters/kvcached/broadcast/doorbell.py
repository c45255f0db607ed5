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
carries nothing: anyone who learns a name can only wake its process early.  The doorbell is a
part of the process registry (:class:`_Doorbell`): a reset stops serving it and closes its
sockets, and the next :func:`start` binds a new one.
"""

from __future__ import annotations

import errno
import os
import socket
import threading

from ... import announce, process_state
from .. import liveness, runner
from ..liveness import ProcessIdentity

log = announce.logger("kvcached_broker.adapters")

PREFIX = "\0kvcached-broker-doorbell-"

#: Tokens drawn before giving up on binding (each a fresh 64-bit draw: only a name taken on
#: purpose, or a broken network namespace, ever fails one).
BIND_ATTEMPTS = 8


class _Doorbell:
    """This process's doorbell: the socket it serves and the thread serving it, the socket it
    rings others from, and how many rings it heard.

    ``lock`` guards ``bound_pid``, ``token``, ``server``, ``thread`` and ``sender``; ``cond``
    guards ``rings`` (which only grows).  ``bound_pid`` is the pid that bound ``server``: a
    doorbell is this process's only while it equals ``os.getpid()``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cond = threading.Condition()
        self.rings = 0
        self.bound_pid = 0
        self.token = 0
        self.server: socket.socket | None = None
        self.thread: threading.Thread | None = None
        self.sender: socket.socket | None = None
        self.closed = False

    def serve(self, sock: socket.socket) -> None:
        while True:
            try:
                sock.recv(64)
            except OSError:
                return
            if self.closed:
                return
            with self.cond:
                self.rings += 1
                self.cond.notify_all()
            runner.wake()

    def stop(self) -> None:
        """Stop serving, and wake whoever waits for a ring (:func:`wait` then answers -1); never
        waits itself."""
        with self.lock:
            self.closed = True
            server = self.server
        with self.cond:
            self.cond.notify_all()
        if server is not None:
            try:
                server.shutdown(socket.SHUT_RDWR)  # wakes the thread's recv: it sees the part closed
            except OSError:
                pass

    def close(self) -> None:
        """Stop serving (the thread ends) and close both sockets: the name is free again."""
        self.stop()
        with self.lock:
            server, thread, sender = self.server, self.thread, self.sender
            self.bound_pid, self.token, self.server, self.thread, self.sender = 0, 0, None, None, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        for sock in (server, sender):
            if sock is not None:
                sock.close()

    def after_fork_in_child(self) -> None:
        """The child's copies of the parent's doorbell and sender are closed (the child neither
        serves the parent's doorbell nor keeps it bound once the parent is gone); the child binds
        its own on its first :func:`start`."""
        for sock in (self.server, self.sender):
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass
        self.lock, self.cond = threading.Lock(), threading.Condition()
        self.rings, self.bound_pid, self.server, self.thread, self.sender, self.token = 0, 0, None, None, None, 0


def address(who: ProcessIdentity, token: int) -> str:
    """The doorbell of process ``who`` whose record publishes ``token``."""
    return f"{PREFIX}{who.pidns}-{who.pid}-{token:016x}"


def start() -> int:
    """Bind this process's doorbell and serve it (idempotent; again after a fork): its token, as
    records publish it, or 0 if it cannot (peers then poll)."""
    state = process_state.part(_Doorbell)
    with state.lock:
        if state.bound_pid == os.getpid():
            return state.token
        bound = _bind(liveness.own())
        if bound is None:
            return 0
        sock, drawn = bound
        thread = threading.Thread(target=state.serve, args=(sock,), name="kvcached-broker-doorbell", daemon=True)
        state.bound_pid, state.server, state.token, state.thread = os.getpid(), sock, drawn, thread
        thread.start()
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
    state = process_state.part(_Doorbell)
    with state.lock:
        return state.token if state.bound_pid == os.getpid() else 0


def ring(who: ProcessIdentity, token: int) -> None:
    """Wake process ``who`` at the doorbell its record publishes (``token`` 0: it has none).
    Never blocks, never raises."""
    if who.pid <= 0 or token <= 0:
        return
    state = process_state.part(_Doorbell)
    try:
        with state.lock:
            if state.closed:  # a reset is closing this doorbell
                return
            if state.sender is None:
                state.sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                state.sender.setblocking(False)
            state.sender.sendto(b"!", address(who, token))
    except OSError:
        pass  # gone, not listening, or its queue is full: it wakes on its own timeout


def rings() -> int:
    """How many rings this process has heard (pass it to :func:`wait`)."""
    state = process_state.part(_Doorbell)
    with state.cond:
        return state.rings


def wait(seen: int, timeout_s: float) -> int:
    """Wait until a ring after ``seen`` arrives, or ``timeout_s``; the ring count now, or -1 if
    a reset stopped the doorbell (no ring will come: stop waiting)."""
    state = process_state.part(_Doorbell)
    with state.cond:
        state.cond.wait_for(lambda: state.rings > seen or state.closed, timeout=timeout_s)
        return -1 if state.closed else state.rings
