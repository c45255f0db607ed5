"""The admin operations alone (broker/admin_ops.py): ``limit``, ``evict`` and ``simulate``.

``AdminOps`` is called as the request core calls it (a decoded request, a routing id, a
peer, a clock value) with the admin check injected and processes faked; a refusal raises
the ``BrokerError`` the core turns into the error reply, and must change nothing.
"""

from __future__ import annotations

import errno

import msgspec
import pytest

from kvcached_broker.broker.request_core import build_core
from kvcached_broker.broker.device import SimulatedDevice
from kvcached_broker.broker.security import Peer
from kvcached_broker.client import protocol as proto
from kvcached_broker.client.errors import BadRequest, Forbidden, StaleRevision, UnknownSession

from helpers import GIB, CoreSession, FakeProcesses, ledger_fingerprint, local_peer, make_core, restarted_core

ROOT = local_peer(pid=1, uid=0, gid=0)
WORKER_UID = 1000
OPERATOR = local_peer(pid=2, uid=2000, gid=2000)  # an admin by group, not root, not the worker's user


def _core(is_admin=lambda peer: True, **kwargs):
    processes = FakeProcesses()
    return make_core(16 * GIB, processes=processes, is_admin=is_admin, **kwargs), processes


def _result(reply: bytes) -> dict:
    decoded = msgspec.msgpack.decode(reply)
    assert decoded["ok"], decoded
    return decoded["result"]


def _worker(core, instance: str = "w", pages: int = 2) -> CoreSession:
    c = CoreSession(core, instance, page_bytes=GIB, peer=local_peer(pid=4242, uid=WORKER_UID, gid=WORKER_UID))
    c.acquire(pages)
    return c


@pytest.mark.parametrize("op", ["limit", "evict", "simulate"])
def test_only_an_admin_peer_may_and_a_refusal_names_who_asked(op):
    core, _ = _core(is_admin=lambda peer: peer.uid == 0)
    c = _worker(core)
    before = ledger_fingerprint(core.ledger)
    request = {
        "limit": proto.SetLimit(id=1, instance="w", max_bytes=GIB),
        "evict": proto.Evict(id=1, session_id=c.session_id),
        "simulate": proto.Simulate(id=1, external_bytes=GIB),
    }[op]
    handler = {"limit": core.admin.set_limit, "evict": core.admin.evict, "simulate": core.admin.simulate}[op]
    with pytest.raises(Forbidden, match=rf"\] {op} is an admin operation; uid 2000 is not root"):
        handler(request, b"r", OPERATOR, 0.0)
    remote = Peer(None, None, None, "10.0.0.7")
    with pytest.raises(Forbidden, match="remote peer 10.0.0.7"):
        handler(request, b"r", remote, 0.0)
    assert ledger_fingerprint(core.ledger) == before and core.table.by_id(c.session_id) is not None
    assert _result(handler(request, b"r", ROOT, 0.0))


def test_set_limit_keeps_the_fields_a_request_leaves_out():
    core, _ = _core()
    first = _result(core.admin.set_limit(proto.SetLimit(id=1, instance="w", max_bytes=4 * GIB, weight=2.0),
                                         b"r", ROOT, 0.0))
    assert first["instance"] == "w" and first["max_bytes"] == 4 * GIB and first["weight"] == 2.0
    second = _result(core.admin.set_limit(proto.SetLimit(id=2, instance="w", min_bytes=GIB), b"r", ROOT, 0.0))
    assert (second["max_bytes"], second["min_bytes"], second["weight"]) == (4 * GIB, GIB, 2.0)
    cleared = _result(core.admin.set_limit(proto.SetLimit(id=3, instance="w", max_bytes=None), b"r", ROOT, 0.0))
    assert cleared["max_bytes"] is None and cleared["min_bytes"] == GIB
    assert core.ledger.limits["w"].source == "admin"


def test_set_limit_with_an_old_revision_is_refused_and_changes_nothing():
    core, _ = _core()
    current = _result(core.admin.set_limit(proto.SetLimit(id=1, instance="w", max_bytes=4 * GIB), b"r", ROOT, 0.0))
    with pytest.raises(StaleRevision):
        core.admin.set_limit(proto.SetLimit(id=2, instance="w", max_bytes=GIB, revision=current["revision"] - 1),
                             b"r", ROOT, 0.0)
    assert core.ledger.limits["w"].max_bytes == 4 * GIB


def test_evict_fences_the_token_journals_the_fence_and_frees_the_session(tmp_path):
    processes = FakeProcesses()
    core = restarted_core(tmp_path, 16 * GIB, processes=processes, is_admin=lambda peer: True)
    c = _worker(core, pages=3)
    result = _result(core.admin.evict(proto.Evict(id=1, session_id=c.session_id), b"r", ROOT, 0.0))
    core.journal.commit(0.0)
    assert result == {"evicted": c.session_id, "killed": False, "freed_bytes": 3 * GIB}
    assert core.table.fenced == {c.token: c.session_id}
    assert restarted_core(tmp_path, 16 * GIB).table.fenced == {c.token: c.session_id}  # the fence is on disk
    assert c.session_id not in core.ledger.sessions and core.counters.reclaims == {"evicted": 1}
    assert processes.killed == []
    assert c.error("heartbeat")["code"] == "evicted"


def test_evict_of_an_unknown_session_is_refused():
    core, _ = _core()
    with pytest.raises(UnknownSession, match="s-00000099"):
        core.admin.evict(proto.Evict(id=1, session_id="s-00000099"), b"r", ROOT, 0.0)


@pytest.mark.parametrize("killer", ["root", "same_user"])
def test_evict_kill_signals_where_the_admin_could_itself(killer):
    core, processes = _core()
    c = _worker(core)
    peer = ROOT if killer == "root" else local_peer(pid=3, uid=WORKER_UID, gid=WORKER_UID)
    result = _result(core.admin.evict(proto.Evict(id=1, session_id=c.session_id, kill=True), b"r", peer, 0.0))
    assert result["killed"] is True and processes.killed == [4242]
    assert c.session_id not in core.ledger.sessions


def test_evict_kill_of_another_users_process_is_refused_whole():
    core, processes = _core()
    c = _worker(core)
    before = ledger_fingerprint(core.ledger)
    with pytest.raises(Forbidden, match="may not kill pid 4242 .uid 1000.*Nothing was evicted"):
        core.admin.evict(proto.Evict(id=1, session_id=c.session_id, kill=True), b"r", OPERATOR, 0.0)
    assert processes.killed == [] and ledger_fingerprint(core.ledger) == before
    assert core.table.fenced == {} and core.table.by_id(c.session_id) is not None
    result = _result(core.admin.evict(proto.Evict(id=2, session_id=c.session_id), b"r", OPERATOR, 0.0))
    assert result["killed"] is False  # without --kill, the operator may evict it


def test_evict_kill_that_cannot_signal_still_evicts_and_says_why():
    core, processes = _core()
    c = _worker(core)

    def refuse(pid):
        raise OSError(errno.EPERM, "Operation not permitted")

    processes.kill = refuse
    result = _result(core.admin.evict(proto.Evict(id=1, session_id=c.session_id, kill=True), b"r", ROOT, 0.0))
    assert result["killed"] is False and result["kill_error"] == "Operation not permitted"
    assert c.session_id not in core.ledger.sessions


def test_evict_kill_of_an_unverified_pid_kills_nothing():
    core, processes = _core()
    c = CoreSession(core, "w", peer=local_peer(pid=0), pid=5555)  # no kernel pid: another namespace
    result = _result(core.admin.evict(proto.Evict(id=1, session_id=c.session_id, kill=True), b"r", ROOT, 0.0))
    assert result["killed"] is False and "not verified" in result["kill_error"] and processes.killed == []
    assert not core.ledger.sessions


def test_simulate_sets_usage_and_reads_the_device_at_once():
    core, _ = _core()
    result = _result(core.admin.simulate(proto.Simulate(id=1, external_bytes=3 * GIB), b"r", ROOT, 0.0))
    assert result == {"external_bytes": 3 * GIB, "budget_bytes": 13 * GIB}
    assert core.ledger.external_bytes == 3 * GIB


def test_simulate_for_a_process_that_does_not_run_is_refused_and_changes_nothing():
    starts = {4242: 10}
    core = build_core(SimulatedDevice(0, 16 * GIB, start_ticks=starts.get), FakeProcesses(), headroom="0",
                      is_admin=lambda peer: True)
    with pytest.raises(BadRequest, match="no running process 999"):
        core.admin.simulate(proto.Simulate(id=1, external_bytes=GIB, process_bytes={4242: GIB, 999: GIB}),
                            b"r", ROOT, 0.0)
    assert core.ledger.external_bytes == 0 and core.device.probe.read().process_bytes == {}


def test_simulate_needs_a_simulated_device():
    class Nvml:  # a probe that is not a SimulatedDevice
        info = SimulatedDevice(0, GIB).info

        def read(self):
            return SimulatedDevice(0, 16 * GIB).read()

    core = build_core(Nvml(), FakeProcesses(), headroom="0", is_admin=lambda peer: True)
    with pytest.raises(BadRequest, match="only on a simulated device"):
        core.admin.simulate(proto.Simulate(id=1, external_bytes=GIB), b"r", ROOT, 0.0)
