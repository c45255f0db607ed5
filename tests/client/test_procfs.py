"""The one ``/proc`` reader (client/procfs.py) and every place that asks whether a process runs."""

from __future__ import annotations

import os
import subprocess
import sys

from kvcached_broker.adapters.kvcached import liveness as shm_liveness
from kvcached_broker.broker import device, liveness
from kvcached_broker.client.procfs import running_start_ticks


def _zombie() -> subprocess.Popen:
    """A child that has exited and is not reaped yet: a zombie until ``wait``."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    child.stdin.close()  # it exits
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # wait for the exit, leave it unreaped
    return child


def test_a_running_process_has_a_start_time_and_a_zombie_does_not_run_anywhere():
    assert running_start_ticks(os.getpid()) == running_start_ticks("self") is not None
    child = _zombie()
    try:
        with open(f"/proc/{child.pid}/stat", "rb") as f:
            assert b") Z " in f.read()  # the pid is still there, as a zombie
        assert running_start_ticks(child.pid) is None
        assert not liveness.process_alive(child.pid, None)  # the broker once kept its memory charged
        assert shm_liveness.start_ticks(child.pid) is None
        assert device.running_start_ticks is running_start_ticks
    finally:
        child.wait()
    assert running_start_ticks(child.pid) is None  # reaped: gone


def test_a_pid_that_started_at_another_time_is_another_process():
    me = os.getpid()
    ticks = running_start_ticks(me)
    assert liveness.process_alive(me, ticks) and not liveness.process_alive(me, ticks + 1)
