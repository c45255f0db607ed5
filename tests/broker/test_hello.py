"""Opening and resuming sessions (broker/session_opener.py), driven through the request core
(``helpers.CoreSession``, no socket): retried hellos, ownership of a session, version and
device checks, per-pid, per-uid and hello-rate quotas, and what a hello may claim to hold.

The connection a session is bound to is the core's routing id and the pid a hello is checked
against is the peer's: what the socket gives the core, given here directly.  Hellos over real
sockets, across real restarts, are in test_recovery.py and test_protocol_doc.py."""

from __future__ import annotations

import os

import pytest

from kvcached_broker.broker.quotas import SessionQuotas

from helpers import GIB, CoreConnection, CoreSession, make_core, restarted_core


def test_retried_hello_gets_the_same_session():
    core = make_core(80 * GIB)
    conn = CoreConnection(core)
    hello = {"op": "hello", "id": 1, "versions": [1], "instance": "x", "pid": os.getpid(), "page_bytes": 4096,
             "nonce": "same-nonce-123"}
    first = conn.ask(hello)["result"]
    second = conn.ask(hello)["result"]
    assert first["session"] == second["session"] and len(core.ledger.sessions) == 1


def test_session_is_usable_only_from_its_own_connection():
    core = make_core(80 * GIB)
    c = CoreSession(core)
    other = CoreConnection(core)  # the same process, another connection
    reply = other.ask({"op": "acquire", "id": 1, "session": c.token, "pages": 1})
    assert reply["ok"] is False and reply["error"]["code"] == "not_owner"
    assert core.ledger.sessions[c.session_id].granted_pages == 0


def test_hello_with_a_false_pid_is_refused():
    core = make_core(80 * GIB)
    reply = CoreConnection(core).ask({"op": "hello", "id": 1, "versions": [1], "instance": "x", "pid": 1,
                                      "page_bytes": 4096, "nonce": "liar-nonce-1"})
    assert reply["error"]["code"] == "not_owner" and "pid 1" in reply["error"]["message"]
    assert not core.ledger.sessions


def test_unsupported_version_and_wrong_device_are_refused():
    core = make_core(80 * GIB)
    conn = CoreConnection(core)
    base = {"op": "hello", "instance": "x", "pid": os.getpid(), "page_bytes": 4096}
    reply = conn.ask({**base, "id": 1, "versions": [99], "nonce": "version-nonce"})
    assert reply["error"]["code"] == "unsupported_version"
    reply = conn.ask({**base, "id": 2, "versions": [1], "nonce": "device-nonce", "device_uuid": "GPU-other"})
    assert reply["error"]["code"] == "wrong_device"
    assert not core.ledger.sessions


def _refused_hello(core, instance: str) -> dict:
    reply = CoreConnection(core).hello(f"nonce-{instance}", instance=instance)
    assert reply["ok"] is False and reply["error"]["code"] == "rate_limited", reply  # RateLimited, to a client
    return reply["error"]


def _close(session: CoreSession) -> None:
    session.result("close")


def test_sessions_per_pid_and_hello_rate_are_capped():
    core = make_core(80 * GIB, quotas=SessionQuotas(max_sessions_per_pid=3, hello_rate_per_s=0.001, hello_burst=5))
    clients = [CoreSession(core, f"m{i}") for i in range(3)]
    assert "3 sessions" in _refused_hello(core, "m3")["message"]
    _close(clients.pop())
    clients.append(CoreSession(core, "m4"))  # 5th hello: the burst is spent now
    _close(clients.pop())
    assert "too many hellos" in _refused_hello(core, "m5")["message"]


def test_one_uid_cannot_fill_the_session_table():
    core = make_core(80 * GIB, quotas=SessionQuotas(max_sessions_per_uid=4, max_sessions_per_pid=64))
    clients = [CoreSession(core, f"u{i}") for i in range(4)]
    assert f"uid {os.getuid()}" in _refused_hello(core, "u4")["message"]
    _close(clients.pop())
    clients.append(CoreSession(core, "u5"))  # a slot came free


@pytest.mark.parametrize(
    "holdings",
    [
        {"granted_pages": 10 * GIB // 4096},  # past a 1 GiB cap
        {"granted_pages": 78 * GIB // 4096},  # past the 64 GiB device
        {"granted_pages": 1 << 40},  # 2**40 pages of the largest page size
        {"pools": {"weights": 70 * GIB}, "granted_pages": 0},
    ],
)
def test_a_fresh_hello_adopts_no_claimed_holdings(holdings):
    core = make_core(64 * GIB, is_admin=lambda peer: True)
    assert CoreConnection(core).ask({"op": "limit", "id": 1, "instance": "claimer", "max_bytes": GIB})["ok"]
    page_bytes = (1 << 40) if holdings["granted_pages"] == 1 << 40 else 4096
    reply = CoreConnection(core).hello("claim-nonce-1", page_bytes=min(page_bytes, 64 * GIB), holdings=holdings)
    assert reply["ok"], reply
    assert reply["result"]["holdings"] == {"pools": {}, "granted_pages": 0, "reserve_pages": 0, "holds": {},
                                           "mapped_pages": 0}
    honest = CoreSession(core, "honest")
    assert honest.acquire(8) == 8  # nobody was locked out
    _close(honest)
    status = honest.status()  # and status still answers
    assert status["granted_bytes"] == 0 and status["reserved_bytes"] == 0 and not status["overcommitted"]


def test_a_resume_claiming_more_than_its_checkpoint_passes_admission(short_tmp):
    """After a restart a worker re-asserts what it holds; a claim above the checkpoint must
    fit like any grant, and one that does not keeps the checkpoint's figures.  The restart is
    the core's: a new one restored from the first one's journal."""
    state = short_tmp / "state"
    core = restarted_core(state, 8 * GIB)
    conn = CoreConnection(core)
    hello = {"op": "hello", "id": 1, "versions": [1], "instance": "r", "pid": os.getpid(), "page_bytes": GIB,
             "nonce": "resume-nonce-1"}
    token = conn.ask(hello)["result"]["session"]
    assert conn.ask({"op": "acquire", "id": 2, "session": token, "pages": 2})["result"]["granted"] == 2
    core.journal.commit(0.0)  # the round's commit, before its replies would go out
    core.journal.close()

    core = restarted_core(state, 8 * GIB)
    conn = CoreConnection(core)  # the worker's new connection
    claim = {**hello, "id": 3, "nonce": "resume-nonce-2", "resume": token, "holdings": {"granted_pages": 100}}
    reply = conn.ask(claim)
    assert reply["ok"] and reply["result"]["holdings"]["granted_pages"] == 2  # 100 GiB do not fit in 8
    assert conn.ask({**claim, "id": 4, "nonce": "resume-nonce-3", "holdings": {"granted_pages": 3}})["ok"]
    (session,) = core.ledger.sessions.values()
    assert session.granted_pages == 2  # a session resumed once adopts no more claims
    core.journal.close()


# ------------------------------------------------------ limits a hello asks for (issue 26, item 5)
def _peer(uid: int, pid: int):
    from helpers import local_peer

    return local_peer(pid=pid, uid=uid, gid=uid)


def _limited_hello(core, uid: int, pid: int, instance: str, limits: dict | None = None):
    """A hello of process ``pid`` of user ``uid`` (``FakeProcesses``: every pid runs) under
    ``instance``: (its answer's result, the instance's limits in status)."""
    conn = CoreConnection(core, _peer(uid, pid))
    extra = {} if limits is None else {"limits": limits}
    reply = conn.hello(f"nonce-{uid}-{pid}-{instance}", instance=instance, page_bytes=GIB, **extra)
    assert reply["ok"], reply
    view = next(i for i in conn.status()["instances"] if i["name"] == instance)
    return reply["result"], {key: view[key] for key in ("max_bytes", "min_bytes", "weight")}


UNLIMITED = {"max_bytes": None, "min_bytes": 0, "weight": 1.0}


def test_a_hello_may_not_set_limits_on_an_instance_of_another_user():
    """A non-admin peer opened a session under another user's instance name with max_bytes 0
    and capped it at 0.  Its session opens; its limits do not apply (``forbidden``)."""
    core = make_core(16 * GIB)
    _limited_hello(core, 1000, 5001, "prod")
    result, limits = _limited_hello(core, 2000, 5002, "prod", {"max_bytes": 0})
    assert result["hello_limits"]["outcome"] == "forbidden" and "another uid" in result["hello_limits"]["reason"]
    assert limits == UNLIMITED
    result, limits = _limited_hello(core, 1000, 5003, "prod", {"max_bytes": 4 * GIB})  # not alone either now
    assert result["hello_limits"]["outcome"] == "forbidden" and limits == UNLIMITED


def test_limits_a_hello_set_go_when_another_users_session_joins():
    """Squatting the name first does not work either: the limits were the squatter's to ask
    for an instance of its own, and it is no longer its own."""
    core = make_core(16 * GIB)
    result, limits = _limited_hello(core, 2000, 5002, "prod", {"max_bytes": 0})
    assert result["hello_limits"] == {"outcome": "applied", "reason": ""} and limits["max_bytes"] == 0
    _, limits = _limited_hello(core, 1000, 5001, "prod")
    assert limits == UNLIMITED


def test_a_hello_of_the_same_user_sets_its_own_instances_limits_within_the_admins_bounds():
    """Another asked for a floor of the whole budget and weight 1e6, and the broker asked a
    bystander for 198,968 pages.  A hello's floor is cut to a share of the budget, its weight
    to a maximum, its priority too (config ``hello_max_floor_share``, ``hello_max_weight``,
    ``hello_max_priority``: by default a hello may lower its priority, never raise it past 0, so
    that a worker cannot have other users' servers asked for memory back before its own)."""
    core = make_core(16 * GIB)
    _limited_hello(core, 1000, 5001, "mine")
    result, limits = _limited_hello(core, 1000, 5002, "mine", {"min_bytes": 16 * GIB, "weight": 1e6})
    assert result["hello_limits"]["outcome"] == "clamped"
    assert limits == {"max_bytes": None, "min_bytes": 8 * GIB, "weight": 4.0}
    result, limits = _limited_hello(core, 1000, 5003, "other", {"priority": 1000})
    assert result["hello_limits"]["outcome"] == "clamped" and "priority cut to 0" in result["hello_limits"]["reason"]
    assert core.ledger.limits["other"].priority == 0
    result, _ = _limited_hello(core, 1000, 5004, "volunteer", {"priority": -10})  # asked first: its own choice
    assert result["hello_limits"]["outcome"] == "applied" and core.ledger.limits["volunteer"].priority == -10
    strict = make_core(16 * GIB, quotas=SessionQuotas(hello_max_floor_share=0.125, hello_max_weight=1.0))
    result, limits = _limited_hello(strict, 1000, 5001, "mine", {"min_bytes": 16 * GIB, "weight": 2.0})
    assert limits == {"max_bytes": None, "min_bytes": 2 * GIB, "weight": 1.0}
    result, limits = _limited_hello(strict, 1000, 5002, "mine", {"max_bytes": 3 * GIB, "weight": 0.5})
    assert result["hello_limits"]["outcome"] == "applied" and limits["max_bytes"] == 3 * GIB


def test_a_peer_whose_uid_is_unknown_sets_no_limits():
    from kvcached_broker.broker.security import Peer

    core = make_core(16 * GIB)
    conn = CoreConnection(core, Peer(None, None, 0, "tcp://127.0.0.1:5000"))
    reply = conn.hello("nonce-tcp-peer", instance="remote", page_bytes=GIB, pid=4242, limits={"max_bytes": 0})
    assert reply["result"]["hello_limits"]["outcome"] == "forbidden"
    assert "uid is unknown" in reply["result"]["hello_limits"]["reason"]


def test_the_owner_of_hello_limits_survives_a_restart(tmp_path):
    core = restarted_core(tmp_path / "state", 16 * GIB)
    _limited_hello(core, 2000, 5002, "prod", {"max_bytes": 0})
    core.journal.commit(0.0)
    core.journal.store.close()
    core = restarted_core(tmp_path / "state", 16 * GIB)
    assert core.ledger.limits["prod"].owner_uid == 2000
    _, limits = _limited_hello(core, 1000, 5001, "prod")  # the squatter's session restored; another uid joins
    assert limits == UNLIMITED


@pytest.mark.parametrize("others", [0, 1], ids=["alone", "with_the_worker"])
def test_a_greedy_hello_of_another_uid_leaves_no_limits_behind(others):
    """The chaos run's check (issue 26, item 5) read a hello of uid 65534 under a worker's
    instance as leaving default limits behind.  Alone on the name, its greedy ask (a cap of 0
    under a floor of the whole budget) is ``ignored``; beside the worker's session it is
    ``forbidden``; either way, once it closes, the instance has no limits entry of any kind, and
    without the worker no longer appears in status at all."""
    core = make_core(16 * GIB)
    if others:
        _limited_hello(core, 1000, 5001, "prod")
    greedy = {"max_bytes": 0, "min_bytes": 16 * GIB, "weight": 1e6, "priority": 1000}
    squatter = CoreSession(core, "prod", page_bytes=GIB, peer=_peer(65534, 5002), limits=greedy)
    assert squatter.opened["hello_limits"]["outcome"] == ("forbidden" if others else "ignored")
    _close(squatter)
    assert "prod" not in core.ledger.limits
    names = [i["name"] for i in CoreConnection(core).status()["instances"]]
    assert names == (["prod"] if others else [])
