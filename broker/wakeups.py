"""Process exits and wake-ups, delivered as messages on the broker's own socket.

The shell waits in one blocking ``recv`` on its ROUTER socket rather than a ``zmq_poll`` over
the socket, the pidfds and a wake pipe (docs/performance.md, "The receive loop").  So whatever
else must wake the shell arrives on that socket.  :class:`WakeupThread` waits on the
pidfds and on a wake pipe with ``epoll`` and posts one message per event over ``inproc`` to the
ROUTER, from a DEALER whose routing id is a random token (:attr:`WakeupThread.routing_id`):

* ``exit:PID`` when a watched process has exited (each pid at most once until it is unwatched);
* ``wake`` when :meth:`WakeupThread.wake` was called (a stop, a snapshot request).

Invariant: a pid is posted only while it is watched and its pidfd is readable, both checked
under the lock that :meth:`watch` and :meth:`unwatch` take, so a pidfd number that was closed
and reused for another process is never reported for the old one.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading

import zmq

from ..client.procfs import running_start_ticks
from .liveness import PidWatcher, process_alive

log = logging.getLogger("kvcached_broker.server")

_WAKE = b"wake"
_EXIT_PREFIX = b"exit:"


def parse_wakeup(body: bytes) -> int | None:
    """The pid an ``exit:PID`` message names, or None for a plain wake-up."""
    if body.startswith(_EXIT_PREFIX):
        return int(body[len(_EXIT_PREFIX):])
    return None


class WakeupThread:
    """Watches pidfds and a wake pipe; posts their events to ``endpoint`` (an inproc ROUTER)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str):
        self.routing_id = b"\x7fwakeup-" + os.urandom(16).hex().encode()
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.ROUTING_ID, self.routing_id)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # never drop an exit
        self._sock.connect(endpoint)
        self._pids = PidWatcher()
        self._lock = threading.Lock()
        self._epoll = select.epoll()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="kvcached-broker-wakeups", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------- shell side
    def watch(self, pid: int) -> bool:
        """Start watching ``pid``; False if it is already gone.  Raises OSError without pidfds."""
        with self._lock:
            fd = self._pids.watch(pid)
            if fd is not None:
                self._epoll.register(fd, select.EPOLLIN)
        return True

    def unwatch(self, pid: int) -> None:
        with self._lock:
            self._pids.unwatch(pid)  # closing the fd also takes it out of the epoll set

    def wake(self) -> None:
        """Post a ``wake`` message (thread- and signal-safe)."""
        try:
            os.write(self._wake_w, b"w")
        except OSError:  # closed, or the pipe is full and a wake-up is already pending
            pass

    def close(self) -> None:
        """Stop the thread and close its socket (before the context is terminated)."""
        self._closing = True
        self.wake()
        self._thread.join(timeout=5.0)
        with self._lock:
            self._pids.close()
        self._epoll.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    # ---------------------------------------------------------- its thread
    def _run(self) -> None:
        try:
            while not self._closing:
                for fd, _ in self._epoll.poll():
                    if fd == self._wake_r:
                        self._drain_wake_pipe()
                    else:
                        self._post_exit(fd)
        except Exception as exc:  # noqa: BLE001 - the shell still sees exits through the lease
            log.error("event=wakeup_thread_failed error=%r", exc)
        finally:
            self._sock.close(0)

    def _drain_wake_pipe(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        if not self._closing:
            self._sock.send(_WAKE)

    def _post_exit(self, fd: int) -> None:
        with self._lock:
            pid = self._pids.pid_of(fd)
            if pid is None or not _readable(fd):
                return
            self._epoll.unregister(fd)  # it stays readable; one message per exit
        self._sock.send(_EXIT_PREFIX + str(pid).encode())


class PidfdProcesses:
    """``ProcessOps`` on a real machine: ``/proc`` for start times, pidfds in the wake-up thread.

    Pids watched before the shell has a socket (:meth:`attach`) are watched once it has one.
    """

    def __init__(self) -> None:
        self._wakeups: WakeupThread | None = None
        self._early: set[int] = set()

    def attach(self, wakeups: WakeupThread) -> None:
        self._wakeups = wakeups
        for pid in sorted(self._early):
            self.watch(pid)
        self._early.clear()

    def start_ticks(self, pid: int) -> int | None:
        return running_start_ticks(pid)

    def alive(self, pid: int, start_ticks: int | None) -> bool:
        return process_alive(pid, start_ticks)

    def kill(self, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)

    def watch(self, pid: int) -> bool:
        if self._wakeups is None:
            self._early.add(pid)
            return running_start_ticks(pid) is not None
        try:
            self._wakeups.watch(pid)
        except ProcessLookupError:
            return False
        except OSError as exc:
            log.warning("event=pidfd_unavailable pid=%d error=%s detail=lease_only", pid, exc.strerror)
        return True

    def unwatch(self, pid: int) -> None:
        if self._wakeups is None:
            self._early.discard(pid)
        else:
            self._wakeups.unwatch(pid)

    def close(self) -> None:
        if self._wakeups is not None:
            self._wakeups.close()
            self._wakeups = None


def _readable(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))
