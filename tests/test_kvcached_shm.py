"""kvcached mode's files in /dev/shm: this user's own, private, and judged across PID namespaces.

Real processes and files throughout.  "Another user" is a child of this test that dropped to
uid 65534 (nobody) before touching anything (tests run as root here; elsewhere those tests
skip); "another PID namespace" is a process started by util-linux's ``unshare --pid --fork
--mount-proc``, as a container sharing ``/dev/shm`` and the network namespace with the host
(``--ipc=host --network=host``) runs: its pids mean other processes here.  Files live in a
private directory on ``/dev/shm``'s tmpfs made world-writable and sticky like ``/dev/shm``.

What is checked: the board, the segment and its record are refused (one line, never applied,
nothing written) when another user made them, when others may write them, when they are a
symbolic link or a FIFO; the board sweep never removes a board whose writer runs in another
PID namespace, nor judges a pid when ``/proc`` is not its namespace's; doorbells of processes
with the same pid in two PID namespaces do not collide; a cap recorded for a server that is gone
is dropped when the next server attaches, and its segment and record are collected.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from kvcached_broker.adapters.kvcached import board as board_mod
from kvcached_broker.adapters.kvcached import liveness


def _unshare_works() -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    return probe.returncode == 0


two_namespaces = pytest.mark.skipif(not _unshare_works(), reason="unshare --pid --fork --mount-proc unavailable")


@pytest.fixture
def shm_dir():
    """A directory on /dev/shm's tmpfs, world-writable and sticky as /dev/shm is."""
    path = Path("/dev/shm") / f"kvb-test-{uuid.uuid4().hex[:10]}"
    path.mkdir()
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Child:
    """A Python process driven by JSON lines (``python -c``), optionally in a new PID namespace."""

    def __init__(self, code: str, *, new_pid_namespace: bool = False, mount_proc: bool = True):
        argv = [sys.executable, "-c", textwrap.dedent(code)]
        if new_pid_namespace:
            argv = ["unshare", "--pid", "--fork", *(["--mount-proc"] if mount_proc else []), "--kill-child", *argv]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)

    def receive(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"the child exited: {self.proc.wait(timeout=30)}\n{self.proc.stderr.read()[-3000:]}"
        return json.loads(line)

    def send(self, **message) -> None:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        """SIGKILL the Python process (in a new PID namespace: ``unshare``'s child, seen here by its
        pid in this namespace), and return once it is gone (its pidfd readable; bounded for a
        failure only)."""
        inner = self._inner_pids()
        pidfds = [os.pidfd_open(pid) for pid in inner]
        for pid in inner or [self.proc.pid]:
            os.kill(pid, signal.SIGKILL)
        for fd in pidfds:
            select.select([fd], [], [], 30)
            os.close(fd)
        self.proc.wait(timeout=30)

    def _inner_pids(self) -> list[int]:
        try:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                return [int(pid) for pid in f.read().split()]
        except OSError:
            return []

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


@pytest.fixture
def children():
    started: list[Child] = []

    def start(code: str, **kwargs) -> Child:
        child = Child(code, **kwargs)
        started.append(child)
        return child

    yield start
    for child in started:
        if child.proc.poll() is None:
            child.kill()


# ------------------------------------------------------------------ the board
@two_namespaces
def test_a_board_whose_writer_runs_in_another_pid_namespace_is_never_swept(shm_dir, children):
    path = shm_dir / "kvcached-broker-container-g0.board"
    writer = children(f"""
        import json, os, sys
        from kvcached_broker.adapters.kvcached import board as b
        me = b.own_identity()
        board = b.Board.join({str(path)!r}, lambda x: x.write_engine(**b.identity_fields(me), state=b.ENGINE_GOVERNING))
        print(json.dumps({{"pid": me.pid, "pidns": me.pidns}}), flush=True)
        sys.stdin.read()
    """, new_pid_namespace=True)
    there = writer.receive()
    assert there["pid"] == 1 and there["pidns"] != liveness.pid_namespace()  # pid 1 here is another process
    dead = board_mod.Board(str(shm_dir / "kvcached-broker-here-g0.board"))  # a writer of this namespace, gone
    dead.write_engine(**board_mod.identity_fields(liveness.ProcessIdentity(2**22 + 1, 1, liveness.pid_namespace())))
    assert board_mod.sweep(str(shm_dir)) == [dead.path]
    assert path.exists()
    assert board_mod.Board(str(path)).engine().state == board_mod.ENGINE_GOVERNING
    writer.end()  # it leaves at exit: the last one out removes the board
    assert not path.exists()
    dead.close()


@two_namespaces
def test_without_its_own_proc_a_process_judges_no_pid_and_sweeps_nothing(shm_dir, children):
    """A process moved into a new PID namespace without mounting /proc reads the parent's
    /proc: a pid of its namespace would be looked up among the parent's processes there."""
    child = children(f"""
        import json
        from kvcached_broker.adapters.kvcached import board, liveness
        here = liveness.pid_namespace()
        stale = board.Board({str(shm_dir / "kvcached-broker-p-g0.board")!r})
        stale.write_engine(**board.identity_fields(liveness.ProcessIdentity(2, 12345, here)))
        print(json.dumps({{"proc_ours": liveness.proc_is_this_namespaces(),
                           "judged": liveness.judge(liveness.ProcessIdentity(2, 12345, here)),
                           "swept": board.sweep({str(shm_dir)!r})}}), flush=True)
    """, new_pid_namespace=True, mount_proc=False)
    assert child.receive() == {"proc_ours": False, "judged": None, "swept": []}
    assert (shm_dir / "kvcached-broker-p-g0.board").exists()


def test_the_board_is_named_for_this_user_and_pid_namespace(monkeypatch):
    path = board_mod.board_path(3, "/tmp/kvcached-tp-kvcached_engine_1-0123abcd")
    assert os.path.basename(path) == (f"kvcached-broker-u{os.geteuid()}-n{liveness.pid_namespace()}-"
                                      "kvcached-tp-kvcached_engine_1-0123abcd-g3.board")
