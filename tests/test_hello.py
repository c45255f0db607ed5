"""Opening and resuming sessions over real sockets (broker/session_opener.py): retried hellos,
ownership of a session, version and device checks, per-pid, per-uid and hello-rate quotas,
and what a hello may claim to hold."""

from __future__ import annotations

import os

import msgpack
import pytest

from helpers import GIB, connect, raw_ask, raw_dealer, raw_hello


def test_retried_hello_gets_the_same_session(inproc):
    sock = raw_dealer(inproc.endpoint)
    hello = {"op": "hello", "id": 1, "versions": [1], "instance": "x", "pid": os.getpid(), "page_bytes": 4096,
             "nonce": "same-nonce-123"}
    first = raw_ask(sock, hello)["result"]
    second = raw_ask(sock, hello)["result"]
    assert first["session"] == second["session"] and len(inproc.ledger.sessions) == 1
    sock.close()


def test_session_is_usable_only_from_its_own_connection(inproc):
    with connect(inproc) as c:
        token = c._core.token
        other = raw_dealer(inproc.endpoint)
        reply = raw_ask(other, {"op": "acquire", "id": 1, "session": token, "pages": 1})
        assert reply["ok"] is False and reply["error"]["code"] == "not_owner"
        assert inproc.ledger.sessions[c.session_id].granted_pages == 0
        other.close()


def test_hello_with_a_false_pid_is_refused(inproc):
    sock = raw_dealer(inproc.endpoint)
    reply = raw_ask(sock, {"op": "hello", "id": 1, "versions": [1], "instance": "x", "pid": 1, "page_bytes": 4096,
                        "nonce": "liar-nonce-1"})
    assert reply["error"]["code"] == "not_owner" and "pid 1" in reply["error"]["message"]
    assert not inproc.ledger.sessions
    sock.close()


def test_unsupported_version_and_wrong_device_are_refused(inproc):
    sock = raw_dealer(inproc.endpoint)
    base = {"op": "hello", "instance": "x", "pid": os.getpid(), "page_bytes": 4096}
    reply = raw_ask(sock, {**base, "id": 1, "versions": [99], "nonce": "version-nonce"})
    assert reply["error"]["code"] == "unsupported_version"
    reply = raw_ask(sock, {**base, "id": 2, "versions": [1], "nonce": "device-nonce", "device_uuid": "GPU-other"})
    assert reply["error"]["code"] == "wrong_device"
    assert not inproc.ledger.sessions
    sock.close()


def test_sessions_per_pid_and_hello_rate_are_capped(inproc_factory):
    from kvcached_broker.client import RateLimited

    b = inproc_factory(max_sessions_per_pid=3, hello_rate_per_s=0.001, hello_burst=5)
    clients = [connect(b, f"m{i}") for i in range(3)]
    with pytest.raises(RateLimited) as info:
        connect(b, "m3")
    assert "3 sessions" in str(info.value)
    clients.pop().close()
    clients.append(connect(b, "m4"))  # 5th hello: the burst is spent now
    clients.pop().close()
    with pytest.raises(RateLimited) as info:
        connect(b, "m5")
    assert "too many hellos" in str(info.value)
    for c in clients:
        c.close()


def test_one_uid_cannot_fill_the_session_table(inproc_factory):
    from kvcached_broker.client import RateLimited

    b = inproc_factory(max_sessions_per_uid=4, max_sessions_per_pid=64)
    clients = [connect(b, f"u{i}") for i in range(4)]
    with pytest.raises(RateLimited) as info:
        connect(b, "u4")
    assert f"uid {os.getuid()}" in str(info.value)
    clients.pop().close()
    clients.append(connect(b, "u5"))  # a slot came free
    for c in clients:
        c.close()


@pytest.mark.parametrize(
    "holdings",
    [
        {"granted_pages": 10 * GIB // 4096},  # past a 1 GiB cap
        {"granted_pages": 78 * GIB // 4096},  # past the 64 GiB device
        {"granted_pages": 1 << 40},  # 2**40 pages of the largest page size
        {"pools": {"weights": 70 * GIB}, "granted_pages": 0},
    ],
)
def test_a_fresh_hello_adopts_no_claimed_holdings(inproc_factory, holdings):
    b = inproc_factory(total_bytes=64 * GIB)
    b.admin().limit("claimer", max_bytes=GIB)
    sock = raw_dealer(b.endpoint)
    page_bytes = (1 << 40) if holdings["granted_pages"] == 1 << 40 else 4096
    reply = raw_hello(sock, "claim-nonce-1", page_bytes=min(page_bytes, 64 * GIB), holdings=holdings)
    assert reply["ok"], reply
    assert reply["result"]["holdings"] == {"pools": {}, "granted_pages": 0, "reserve_pages": 0, "holds": {}}
    with connect(b, "honest") as c:
        assert c.acquire(8) == 8  # nobody was locked out
    status = b.status()  # and status still answers
    assert status["granted_bytes"] == 0 and status["reserved_bytes"] == 0 and not status["overcommitted"]
    sock.close()


def test_a_resume_claiming_more_than_its_checkpoint_passes_admission(short_tmp):
    """After a restart a worker re-asserts what it holds; a claim above the checkpoint must
    fit like any grant, and one that does not keeps the checkpoint's figures."""
    from kvcached_broker.broker.device import SimulatedDevice
    from kvcached_broker.broker.config import ServeConfig
    from kvcached_broker.broker.server import BrokerServer

    def serve():
        server = BrokerServer(ServeConfig(endpoint=f"ipc://{short_tmp}/r.sock", headroom="0",
                                          state_dir=short_tmp / "state"), SimulatedDevice(0, 8 * GIB))
        server.start()
        return server

    server = serve()
    sock = raw_dealer(server.config.endpoint)

    def ask(message):
        sock.send(msgpack.packb(message))
        server.run_round(2000)
        return msgpack.unpackb(sock.recv())

    hello = {"op": "hello", "id": 1, "versions": [1], "instance": "r", "pid": os.getpid(), "page_bytes": GIB,
             "nonce": "resume-nonce-1"}
    token = ask(hello)["result"]["session"]
    assert ask({"op": "acquire", "id": 2, "session": token, "pages": 2})["result"]["granted"] == 2
    sock.close()
    server.close()

    server = serve()
    sock = raw_dealer(server.config.endpoint)
    claim = {**hello, "id": 3, "nonce": "resume-nonce-2", "resume": token, "holdings": {"granted_pages": 100}}
    reply = ask(claim)
    assert reply["ok"] and reply["result"]["holdings"]["granted_pages"] == 2  # 100 GiB do not fit in 8
    assert ask({**claim, "id": 4, "nonce": "resume-nonce-3", "holdings": {"granted_pages": 3}})["ok"]
    (session,) = server.ledger.sessions.values()
    assert session.granted_pages == 2  # a session resumed once adopts no more claims
    sock.close()
    server.close()

