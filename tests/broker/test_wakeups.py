"""Process exits and wake-ups as messages (broker/wakeups.py), with real child processes and a
real ROUTER socket over inproc, as the shell has them.

Every wait is on a message.  That nothing more was posted is shown with a barrier: ``wake()``
is posted by the same thread, after whatever it had to post, so everything before the
``wake`` message is everything the thread posted.
"""

from __future__ import annotations

import os
import signal

import pytest
import zmq

from kvcached_broker.broker.liveness import process_start_ticks
from kvcached_broker.broker.wakeups import PidfdProcesses, WakeupThread, parse_wakeup


class Router:
    """The shell's ROUTER socket, bound on inproc; ``start()`` a wake-up thread posting to it."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.RCVTIMEO, 60_000)  # bounds a failure only
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"inproc://wakeups-test-{os.getpid()}"
        self.sock.bind(self.endpoint)
        self.threads: list[WakeupThread] = []

    def start(self) -> WakeupThread:
        thread = WakeupThread(self.ctx, self.endpoint)
        self.threads.append(thread)
        return thread

    def recv_multipart(self) -> list[bytes]:
        return self.sock.recv_multipart()

    def close(self) -> None:
        for thread in self.threads:
            thread.close()
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def router():
    r = Router()
    yield r
    r.close()


def receive(router, wakeups: WakeupThread) -> bytes:
    rid, body = router.recv_multipart()
    assert rid == wakeups.routing_id
    return body


def posted_until_wake(router, wakeups: WakeupThread) -> list[bytes]:
    """Everything the thread posts before a ``wake`` asked for now."""
    wakeups.wake()
    bodies = []
    while (body := receive(router, wakeups)) != b"wake":
        bodies.append(body)
    return bodies


def test_an_exit_is_posted_once_per_watch(router, children):
    wakeups = router.start()
    child = children()
    assert wakeups.watch(child.pid)
    child.kill()  # not reaped: the pid stays a zombie, and its pidfd stays readable
    assert receive(router, wakeups) == b"exit:%d" % child.pid
    assert posted_until_wake(router, wakeups) == []  # readable still, but posted once
    wakeups.unwatch(child.pid)
    assert wakeups.watch(child.pid)  # watched again: its exit is news to the new watch
    assert receive(router, wakeups) == b"exit:%d" % child.pid
    assert posted_until_wake(router, wakeups) == []


def test_a_pid_no_longer_watched_is_never_reported(router, children):
    wakeups = router.start()
    child = children()
    wakeups.watch(child.pid)
    wakeups.unwatch(child.pid)
    child.kill()
    child.wait(timeout=60)
    assert posted_until_wake(router, wakeups) == []


def test_a_reused_fd_is_never_reported_for_the_old_pid(router, children):
    wakeups = router.start()
    old, new = children(), children()
    wakeups.watch(old.pid)
    old_fd = wakeups._pids._fd_by_pid[old.pid]
    wakeups.unwatch(old.pid)
    wakeups.watch(new.pid)
    assert wakeups._pids._fd_by_pid[new.pid] == old_fd  # the number was reused
    old.kill()
    old.wait(timeout=60)
    assert posted_until_wake(router, wakeups) == []
    wakeups._post_exit(old_fd)  # an event for that number, handled late: it is the live process's now
    assert posted_until_wake(router, wakeups) == []
    new.kill()
    assert receive(router, wakeups) == b"exit:%d" % new.pid


def test_wake_posts_a_wake(router):
    wakeups = router.start()
    wakeups.wake()
    assert receive(router, wakeups) == b"wake"
    for _ in range(5):
        wakeups.wake()  # several before the thread runs may come as one
    assert receive(router, wakeups) == b"wake"


def test_watching_a_process_that_is_gone_raises(router, children):
    wakeups = router.start()
    child = children()
    child.kill()
    child.wait(timeout=60)  # reaped: no such process any more
    with pytest.raises(ProcessLookupError):
        wakeups.watch(child.pid)
    assert posted_until_wake(router, wakeups) == []


def test_parse_wakeup():
    assert parse_wakeup(b"exit:4242") == 4242
    assert parse_wakeup(b"wake") is None


def test_pidfd_processes_watch_early_pids_once_attached(router, children):
    processes = PidfdProcesses()
    child, dropped, gone = children(), children(), children()
    gone.kill()
    gone.wait(timeout=60)
    assert processes.watch(child.pid) is True  # no socket yet: remembered
    assert processes.watch(dropped.pid) is True
    processes.unwatch(dropped.pid)  # and forgotten again before the socket came
    assert processes.watch(gone.pid) is False  # already gone: the caller reclaims it at once
    wakeups = router.start()
    processes.attach(wakeups)
    dropped.kill()
    dropped.wait(timeout=60)
    assert posted_until_wake(router, wakeups) == []
    child.kill()
    assert receive(router, wakeups) == b"exit:%d" % child.pid
    router.threads.remove(wakeups)
    processes.close()  # closes the thread it was attached to


def test_pidfd_processes_check_and_kill_processes(children):
    processes = PidfdProcesses()
    me = os.getpid()
    assert processes.start_ticks(me) == process_start_ticks(me) is not None
    assert processes.alive(me, processes.start_ticks(me)) and not processes.alive(me, processes.start_ticks(me) + 1)
    child = children()
    processes.kill(child.pid)
    assert child.wait(timeout=60) == -signal.SIGKILL
    assert processes.start_ticks(child.pid) is None and not processes.alive(child.pid, None)
