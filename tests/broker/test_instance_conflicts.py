"""Instance names that collide are shown, never merged in silence.

Two servers given one ``KVCACHED_BROKER_INSTANCE`` become one instance in the broker.  What gives
them away: two processes holding the same ``tp_rank``, or sessions that disagree on ``tp_size``.
The broker lists each such collision per instance in ``status --json`` (``conflicts``), marks
the instance in the ``status`` table, and logs ``event=instance_collision`` once per new one.
The broker tests use real brokers and worker processes and wait on events, never on time.
"""

from __future__ import annotations

import json
import subprocess

from kvcached_broker.broker.accounts import Session, SessionState
from kvcached_broker.broker.status import instance_conflicts

from helpers import CLI, Worker, connect, wait_for


def _session(sid: str, instance: str, pid: int, rank: int = 0, tp_size: int = 1,
             state: SessionState = SessionState.LIVE) -> Session:
    return Session(id=sid, instance=instance, pid=pid, pid_verified=True, tp_rank=rank, tp_size=tp_size,
                   page_bytes=4096, opened_s=0.0, last_seen_s=0.0, state=state)


# ----------------------------------------------------------------------------- the pure function
def test_one_rank_in_two_processes_is_a_collision_and_in_one_process_is_not():
    sessions = [_session("s-b", "dup", pid=12), _session("s-a", "dup", pid=11), _session("s-c", "dup", pid=11, rank=1),
                _session("s-d", "one", pid=20), _session("s-e", "one", pid=20)]
    assert instance_conflicts(sessions) == {
        "dup": [{"kind": "rank", "rank": 0, "sessions": ["s-a", "s-b"], "pids": [11, 12]}],
    }


def test_sessions_that_disagree_on_tp_size_collide():
    sessions = [_session("s-a", "mixed", pid=11, rank=0, tp_size=2), _session("s-b", "mixed", pid=12, rank=1, tp_size=4),
                _session("s-c", "fine", pid=13, rank=0, tp_size=2), _session("s-d", "fine", pid=14, rank=1, tp_size=2)]
    assert instance_conflicts(sessions) == {
        "mixed": [{"kind": "tp_size", "tp_sizes": [2, 4], "sessions": ["s-a", "s-b"], "pids": [11, 12]}],
    }


def test_only_live_sessions_count():
    """A restarted server's stale or recovering session next to its new one is not a second server."""
    sessions = [_session("s-a", "m", pid=11, state=SessionState.STALE), _session("s-b", "m", pid=12),
                _session("s-c", "m", pid=13, tp_size=2, state=SessionState.RECOVERING)]
    assert instance_conflicts(sessions) == {}


# ----------------------------------------------------------------------------- a real broker
def _conflicts(status: dict) -> dict[str, list]:
    return {inst["name"]: inst["conflicts"] for inst in status["instances"]}


def _table(b) -> str:
    out = subprocess.run([*CLI, "status", "--endpoint", b.endpoint], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _row(table: str, instance: str) -> str:
    (row,) = [line for line in table.splitlines() if line.startswith(instance + " ")]
    return row


def test_two_servers_under_one_name_are_shown_and_logged_once(broker, workers):
    a = Worker(broker.endpoint, "dup", {}, 0)
    workers.append(a)
    b = Worker(broker.endpoint, "dup", {}, 0)  # a second server given the same name: rank 0 again
    workers.append(b)
    workers.append(Worker(broker.endpoint, "solo", {}, 0))
    status = json.loads(subprocess.run([*CLI, "status", "--endpoint", broker.endpoint, "--json"],
                                       capture_output=True, text=True, timeout=120).stdout)
    (dup,) = _conflicts(status)["dup"]
    assert dup == {"kind": "rank", "rank": 0, "sessions": sorted([a.session_id, b.session_id]),
                   "pids": sorted([a.proc.pid, b.proc.pid])}
    assert _conflicts(status)["solo"] == []

    table = _table(broker)
    assert "!COLLISION" in _row(table, "dup") and "!COLLISION" not in _row(table, "solo")
    assert f"! name collision: rank 0 is held by pids {min(a.proc.pid, b.proc.pid)}" in table

    wait_for(lambda: "event=instance_collision instance=dup kind=rank rank=0" in broker.log(),
             what="the collision to be logged")
    with connect(broker, "mixed", tp_rank=0, tp_size=2), connect(broker, "mixed", tp_rank=1, tp_size=4):
        # logged in a later observation than dup's, with dup's collision still there
        wait_for(lambda: "event=instance_collision instance=mixed kind=tp_size tp_sizes=2,4" in broker.log(),
                 what="the tp_size collision to be logged")
        assert broker.log().count("event=instance_collision instance=dup ") == 1
        assert [c["kind"] for c in _conflicts(broker.status())["mixed"]] == ["tp_size"]

    b.kill()  # the second server leaves: nothing collides any more
    wait_for(lambda: _conflicts(broker.status())["dup"] == [], what="the collision to clear")
    assert "!COLLISION" not in _table(broker)


def test_one_process_with_two_sessions_of_one_rank_is_not_a_collision(broker):
    with connect(broker, "same"), connect(broker, "same"):
        assert _conflicts(broker.status())["same"] == []
        assert "!COLLISION" not in _table(broker)
