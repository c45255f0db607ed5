"""How sessions end (broker/lifecycle.py), with processes faked (``helpers.FakeProcesses``).

Every way a session ends goes through ``SessionLifecycle.end``: the ledger frees what it held,
pressure forgets it, limits its own worker asked for at hello leave with its instance, the
table drops it, the end is counted by cause, and its pid is unwatched once no session needs it.
``reclaim_pid`` ends every session of a process that exited.
"""

from __future__ import annotations

import pytest

from helpers import GIB, MIB, CoreConnection, CoreSession, FakeProcesses, local_peer, make_core


def _core(**kwargs):
    processes = FakeProcesses()
    return make_core(16 * GIB, processes=processes, **kwargs), processes


def test_end_frees_what_the_session_held_and_forgets_it_everywhere():
    core, processes = _core()
    c = CoreSession(core, "w", page_bytes=GIB)
    c.result("reserve", pools={"weights": GIB})
    c.acquire(2)
    binding = core.table.by_id(c.session_id)
    freed = core.lifecycle.end(binding, cause="closed")
    assert freed == 3 * GIB
    assert c.session_id not in core.ledger.sessions and core.table.by_id(c.session_id) is None
    assert core.table.by_token(c.token) is None
    assert core.ledger.reserved_bytes == core.ledger.granted_bytes == 0
    assert core.counters.reclaims == {"closed": 1}
    assert processes.watched == set()  # its pid had no other session


def test_a_pid_stays_watched_while_another_of_its_sessions_lives():
    core, processes = _core()
    first, second = CoreSession(core, "a"), CoreSession(core, "b")  # one process, two sessions
    pid = local_peer().pid
    assert processes.watched == {pid}
    core.lifecycle.end(core.table.by_id(first.session_id), cause="closed")
    assert processes.watched == {pid}
    core.lifecycle.end(core.table.by_id(second.session_id), cause="evicted")
    assert processes.watched == set()
    assert core.counters.reclaims == {"closed": 1, "evicted": 1}


@pytest.mark.parametrize("source", ["hello", "admin"])
def test_limits_asked_for_at_hello_leave_with_the_instance_and_no_others(source):
    core, _ = _core(is_admin=lambda peer: True)
    if source == "admin":
        assert CoreConnection(core).ask({"op": "limit", "id": 1, "instance": "w", "max_bytes": 4 * GIB})["ok"]
        c = CoreSession(core, "w", page_bytes=GIB)
    else:
        c = CoreSession(core, "w", page_bytes=GIB, limits={"max_bytes": 4 * GIB})
    other = CoreSession(core, "w", page_bytes=GIB)  # the instance outlives the first session
    assert core.ledger.limits["w"].source == source
    core.lifecycle.end(core.table.by_id(c.session_id), cause="closed")
    assert "w" in core.ledger.limits
    core.lifecycle.end(core.table.by_id(other.session_id), cause="closed")
    assert ("w" in core.ledger.limits) is (source == "admin")


def test_an_ended_session_is_no_longer_asked_for_pages():
    core, _ = _core()
    big = CoreSession(core, "big", page_bytes=GIB)
    small = CoreSession(core, "small", page_bytes=GIB)
    assert big.acquire(16) == 16
    assert small.acquire(2) == 0  # refused; big is above its share: asked for pages
    assert core.pressure.pending and core.take_pushes()
    core.lifecycle.end(core.table.by_id(big.session_id), cause="exited")
    assert not core.pressure.pending
    assert small.acquire(2) == 2


def test_reclaim_pid_ends_every_session_of_that_process_and_only_those():
    core, processes = _core()
    mine = [CoreSession(core, f"m{i}", page_bytes=MIB) for i in range(3)]
    theirs = CoreSession(core, "t", page_bytes=MIB, peer=local_peer(pid=777))
    for c in mine + [theirs]:
        c.acquire(4)
    pid = local_peer().pid
    core.reclaim_pid(pid)
    assert list(core.ledger.sessions) == [theirs.session_id]
    assert core.counters.reclaims == {"exited": 3}
    assert processes.watched == {777}
    assert core.ledger.granted_bytes == 4 * MIB
    core.reclaim_pid(pid)  # reported again, or for a pid with no session: nothing to end
    core.reclaim_pid(4321)
    assert list(core.ledger.sessions) == [theirs.session_id] and core.counters.reclaims == {"exited": 3}


def test_watching_a_process_that_is_already_gone_reclaims_it_at_once():
    core, processes = _core()
    c = CoreSession(core, "w")
    c.acquire(1)
    processes.dead.add(local_peer().pid)
    core.lifecycle.watch(local_peer().pid)
    assert not core.ledger.sessions and core.counters.reclaims == {"exited": 1}


def test_an_unverified_pid_is_never_watched_or_unwatched():
    core, processes = _core()
    remote = local_peer(pid=0)  # another pid namespace: the kernel gives no pid
    c = CoreSession(core, "w", peer=remote, pid=5555)
    assert not c.opened["pid_verified"] and processes.watched == set()
    processes.watched.add(5555)  # were it watched for another reason, ending this session leaves it be
    core.lifecycle.end(core.table.by_id(c.session_id), cause="closed")
    assert processes.watched == {5555}
