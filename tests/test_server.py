"""The broker over real sockets: the client API and the status contract of docs/design.md."""

from __future__ import annotations

import os

import msgpack
import pytest
import zmq

from kvcached_broker.client import BadRequest, BrokerClient, BudgetExceeded
from kvcached_broker.client import protocol as proto

from helpers import GIB, MIB, ledger_fingerprint

DSV4_POOLS = {
    "swa_kv_pool": 3 * GIB,
    "c4_kv_pool": GIB + 512 * MIB,
    "c128_kv_pool": 96 * MIB,
    "c4_indexer_kv_pool": 384 * MIB,
    "compress_state_pools": 200 * MIB,
}

STATUS_KEYS = {
    "device", "total_bytes", "headroom_bytes", "external_bytes", "budget_bytes", "reserved_bytes",
    "granted_bytes", "unreported_bytes", "free_bytes", "overcommitted", "instances",
}
INSTANCE_KEYS = {"name", "max_bytes", "min_bytes", "reserved_bytes", "granted_bytes", "pools", "sessions"}
SESSION_KEYS = {"id", "rank", "tp_size", "pid", "state", "page_bytes", "granted_pages", "pools", "reserve_pages"}


def connect(b, instance="m", **kw):
    kw.setdefault("credit_pages", 0)
    return BrokerClient.connect(instance, endpoint=b.endpoint, **kw)


def test_status_document_has_the_contract_shape(inproc):
    with connect(inproc, "dsv4") as c:
        c.reserve(DSV4_POOLS)
        assert c.acquire(16) == 16
        s = c.status()
    assert STATUS_KEYS <= set(s)
    assert set(s["device"]) == {"index", "uuid", "name", "simulated"} and s["device"]["simulated"] is True
    (inst,) = s["instances"]
    assert INSTANCE_KEYS <= set(inst)
    assert inst["max_bytes"] is None and inst["min_bytes"] == 0
    (sess,) = inst["sessions"]
    assert SESSION_KEYS <= set(sess)
    assert sess["pid"] == os.getpid() and sess["state"] == "live" and sess["rank"] == 0 and sess["tp_size"] == 1
    assert sess["pools"] == DSV4_POOLS and inst["pools"] == DSV4_POOLS
    assert sess["granted_pages"] == 16 and sess["page_bytes"] == 2 * MIB
    assert s["reserved_bytes"] == sum(DSV4_POOLS.values())
    assert s["granted_bytes"] == 16 * 2 * MIB
    assert s["free_bytes"] == s["budget_bytes"] - s["reserved_bytes"] - s["granted_bytes"] - s["unreported_bytes"]
    assert s["overcommitted"] is False


def test_second_instance_fills_the_gpu_to_the_last_page_and_every_byte_matches(inproc_factory):
    b = inproc_factory(total_bytes=80 * GIB, headroom="4GiB")
    with connect(b, "dsv4") as v4, connect(b, "filler", page_bytes=2 * MIB) as filler:
        v4.reserve(DSV4_POOLS)
        assert v4.acquire(100) == 100
        budget = b.status()["budget_bytes"]
        free = budget - sum(DSV4_POOLS.values()) - 100 * 2 * MIB
        last_page = free // (2 * MIB)
        assert filler.acquire(last_page + 1) == 0  # all-or-nothing: one page too many
        assert filler.acquire(last_page) == last_page
        assert filler.acquire(1) == 0
        s = b.status()
        assert s["free_bytes"] == free - last_page * 2 * MIB == 0
        assert s["granted_bytes"] == (100 + last_page) * 2 * MIB
        assert s["reserved_bytes"] == sum(DSV4_POOLS.values())
        by_name = {i["name"]: i for i in s["instances"]}
        assert by_name["filler"]["granted_bytes"] == last_page * 2 * MIB
        assert by_name["dsv4"]["pools"] == DSV4_POOLS
        filler.release(1)
        assert filler.acquire(1) == 1


def test_partial_grant_with_min_pages(inproc_factory):
    b = inproc_factory(total_bytes=100 * MIB)
    with connect(b, page_bytes=10 * MIB) as c:
        assert c.acquire(16, min_pages=4) == 10
        assert c.acquire(4, min_pages=1) == 0
        assert c.held_pages == 10


def test_reserve_refusal_raises_budget_exceeded_naming_the_pool(inproc_factory):
    b = inproc_factory(total_bytes=8 * GIB)
    with connect(b) as c:
        c.reserve({"weights": 6 * GIB})
        with pytest.raises(BudgetExceeded) as info:
            c.reserve({"weights": 6 * GIB, "swa_kv_pool": 3 * GIB})
        assert "swa_kv_pool" in str(info.value) and info.value.details["free_bytes"] == 2 * GIB
        assert c.status()["reserved_bytes"] == 6 * GIB
        assert c.reserve({"weights": 6 * GIB, "swa_kv_pool": 0}) == {"weights": 6 * GIB}


def test_release_more_than_held_is_bad_request(inproc):
    with connect(inproc) as c:
        c.acquire(3)
        with pytest.raises(BadRequest):
            c.release(4)
        assert c.status()["granted_bytes"] == 3 * 2 * MIB


def test_close_releases_everything(inproc):
    c = connect(inproc)
    c.reserve({"weights": GIB})
    c.acquire(8)
    c.close()
    c.close()
    s = inproc.status()
    assert s["instances"] == [] and s["reserved_bytes"] == 0 and s["granted_bytes"] == 0


def test_credit_reserve_is_charged_and_shown_as_reserve_pages(inproc):
    with connect(inproc, credit_pages=8) as c:
        assert c.acquire(1) == 1
        sess = c.status()["instances"][0]["sessions"][0]
        assert sess["granted_pages"] == 9 and sess["reserve_pages"] == 8
        for _ in range(50):  # one page at a time stays inside the reserve: no round trips
            assert c.acquire(1) == 1
            c.release(1)
        assert inproc.ledger.sessions[c.session_id].granted_pages == 9
        c.release(1)
        assert c.held_pages == 0


def test_surplus_above_the_high_watermark_goes_back(inproc):
    with connect(inproc, credit_pages=4) as c:
        assert c.acquire(20) == 20
        c.release(20)
        assert c.reserve_pages == 4  # 24 > high watermark 8: back down to the target
        assert inproc.ledger.sessions[c.session_id].granted_pages == 4


def _raw_dealer(endpoint):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 3000)
    sock.connect(endpoint)
    return sock


def _ask(sock, message: dict) -> dict:
    sock.send(msgpack.packb(message))
    return msgpack.unpackb(sock.recv())


def test_plain_msgpack_client_interoperates(inproc):
    sock = _raw_dealer(inproc.endpoint)
    hello = _ask(sock, {
        "op": "hello", "id": 1, "versions": [1], "instance": "plain", "pid": os.getpid(),
        "page_bytes": 4096, "nonce": "plain-nonce-1",
    })
    assert hello["type"] == "reply" and hello["ok"] is True and hello["id"] == 1
    token = hello["result"]["session"]
    reply = _ask(sock, {"op": "reserve", "id": 2, "session": token, "pools": {"weights": 1 << 20}})
    assert reply["ok"] and reply["result"]["pools"] == {"weights": 1 << 20}
    reply = _ask(sock, {"op": "acquire", "id": 3, "session": token, "pages": 5})
    assert reply["result"]["granted"] == 5
    reply = _ask(sock, {"op": "release", "id": 4, "session": token, "pages": 9})
    assert reply["ok"] is False and reply["error"]["code"] == "bad_request"
    reply = _ask(sock, {"op": "acquire", "id": 3, "session": token, "pages": 5})  # a retry: cached
    assert reply["result"]["granted"] == 5
    assert inproc.ledger.sessions[hello["result"]["session_id"]].granted_pages == 5
    status = _ask(sock, {"op": "status", "id": 5})["result"]
    assert status["granted_bytes"] == 5 * 4096
    sock.close()


def test_retried_hello_gets_the_same_session(inproc):
    sock = _raw_dealer(inproc.endpoint)
    hello = {"op": "hello", "id": 1, "versions": [1], "instance": "x", "pid": os.getpid(), "page_bytes": 4096,
             "nonce": "same-nonce-123"}
    first = _ask(sock, hello)["result"]
    second = _ask(sock, hello)["result"]
    assert first["session"] == second["session"] and len(inproc.ledger.sessions) == 1
    sock.close()


def test_session_is_usable_only_from_its_own_connection(inproc):
    with connect(inproc) as c:
        token = c._core.token
        other = _raw_dealer(inproc.endpoint)
        reply = _ask(other, {"op": "acquire", "id": 1, "session": token, "pages": 1})
        assert reply["ok"] is False and reply["error"]["code"] == "not_owner"
        assert inproc.ledger.sessions[c.session_id].granted_pages == 0
        other.close()


def test_hello_with_a_false_pid_is_refused(inproc):
    sock = _raw_dealer(inproc.endpoint)
    reply = _ask(sock, {"op": "hello", "id": 1, "versions": [1], "instance": "x", "pid": 1, "page_bytes": 4096,
                        "nonce": "liar-nonce-1"})
    assert reply["error"]["code"] == "not_owner" and "pid 1" in reply["error"]["message"]
    assert not inproc.ledger.sessions
    sock.close()


def test_unsupported_version_and_wrong_device_are_refused(inproc):
    sock = _raw_dealer(inproc.endpoint)
    base = {"op": "hello", "instance": "x", "pid": os.getpid(), "page_bytes": 4096}
    reply = _ask(sock, {**base, "id": 1, "versions": [99], "nonce": "version-nonce"})
    assert reply["error"]["code"] == "unsupported_version"
    reply = _ask(sock, {**base, "id": 2, "versions": [1], "nonce": "device-nonce", "device_uuid": "GPU-other"})
    assert reply["error"]["code"] == "wrong_device"
    assert not inproc.ledger.sessions
    sock.close()


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xff\xfe garbage",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"op": "acquire", "id": 1, "session": "x" * 20, "pages": -5}),
        msgpack.packb({"op": "acquire", "id": 1, "session": "x" * 20, "pages": (1 << 64) - 1}),
        msgpack.packb({"op": "reserve", "id": 1, "session": "x" * 20, "pools": {f"p{i}": 1 for i in range(100)}}),
        msgpack.packb({"op": "reserve", "id": 1, "session": "x" * 20, "pools": {"p": "big"}}),
        msgpack.packb({"op": "hello", "id": 1, "versions": [1], "instance": "bad name!", "pid": 1, "page_bytes": 1, "nonce": "n" * 10}),
        msgpack.packb({"op": "nope", "id": 7}),
    ],
)
def test_bad_frames_get_an_error_reply_and_change_nothing(inproc, frame):
    with connect(inproc) as c:
        c.acquire(2)
        before = ledger_fingerprint(inproc.ledger)
        sock = _raw_dealer(inproc.endpoint)
        sock.send(frame)
        reply = msgpack.unpackb(sock.recv())
        assert reply["ok"] is False and reply["error"]["code"] == "bad_request"
        assert ledger_fingerprint(inproc.ledger) == before
        assert c.acquire(1) == 1  # the broker is still serving
        sock.close()


@pytest.mark.parametrize(
    ("token", "code"),
    [("bad token!{}\n" * 2, "unknown_session"), ("é" * 10, "unknown_session"), ("short", "bad_request"), ("x" * 65, "bad_request")],
)
def test_a_token_the_broker_never_issued_is_refused_and_changes_nothing(inproc, token, code):
    with connect(inproc) as c:
        c.acquire(2)
        before = ledger_fingerprint(inproc.ledger)
        sock = _raw_dealer(inproc.endpoint)
        reply = _ask(sock, {"op": "acquire", "id": 1, "session": token, "pages": 1})
        assert reply["ok"] is False and reply["error"]["code"] == code and reply["id"] == 1
        assert ledger_fingerprint(inproc.ledger) == before and inproc.ledger.sessions[c.session_id].granted_pages == 2
        sock.close()


def test_oversized_and_multipart_frames_do_not_hurt_the_broker(inproc):
    sock = _raw_dealer(inproc.endpoint)
    sock.send(b"x" * (proto.MAX_REQUEST_BYTES + 10))  # ZeroMQ drops it and disconnects the peer
    sock.send_multipart([b"a", b"b"])
    with connect(inproc) as c:
        assert c.acquire(1) == 1
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


def test_usage_breakdown_is_shown_but_never_charged(inproc):
    with connect(inproc, "vllm-like") as c:
        c.reserve({"kv_cache": 8 * GIB}, usage={"swa_kv_pool": 8 * GIB, "c4_kv_pool": 8 * GIB})
        s = c.status()
        inst = s["instances"][0]
        assert inst["name"] == "vllm-like"
        assert s["reserved_bytes"] == 8 * GIB  # one buffer, charged once
        assert inst["usage_breakdown"] == {"c4_kv_pool": 8 * GIB, "swa_kv_pool": 8 * GIB}
        assert inst["sessions"][0]["usage_breakdown"] == inst["usage_breakdown"]
        c.reserve({"kv_cache": 8 * GIB})  # usage omitted: kept
        assert c.status()["instances"][0]["usage_breakdown"]["swa_kv_pool"] == 8 * GIB


def test_random_garbage_at_a_real_broker_socket(broker):
    """Thousands of random frames, some oversized, some multipart, over several connections."""
    import random

    rng = random.Random(42)
    with BrokerClient.connect("bystander", endpoint=broker.endpoint, credit_pages=0) as c:
        c.reserve({"weights": GIB})
        c.acquire(7)
        before = broker.status()
        socks = [_raw_dealer(broker.endpoint) for _ in range(4)]
        for i in range(3000):
            sock = socks[i % 4]
            size = rng.choice([0, 1, 7, 64, 300, 5000, 70_000])
            frames = [rng.randbytes(size) for _ in range(rng.choice([1, 1, 1, 2, 3]))]
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                pass
        for sock in socks:
            sock.close()
        assert c.acquire(1) == 1  # still serving, and the bystander's session is intact
        after = broker.status()
        assert after["reserved_bytes"] == before["reserved_bytes"] == GIB
        assert after["granted_bytes"] == before["granted_bytes"] + 2 * MIB
        assert after["broker"]["counters"]["bad_frames"] > 0
    assert broker.proc.poll() is None


def test_a_session_that_never_acquires_keeps_no_idle_credit(inproc):
    import time

    with connect(inproc, "reserver", credit_pages=16) as c:
        c.reserve({"weights": GIB})
        time.sleep(0.3)  # several background rounds
        assert inproc.ledger.sessions[c.session_id].granted_pages == 0
        assert c.acquire(1) == 1
        assert inproc.ledger.sessions[c.session_id].granted_pages == 17  # now the reserve is in use


def _hello(sock, nonce: str, **extra) -> dict:
    return _ask(sock, {"op": "hello", "id": 1, "versions": [1], "instance": extra.pop("instance", "claimer"),
                       "pid": os.getpid(), "page_bytes": extra.pop("page_bytes", 4096), "nonce": nonce, **extra})


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
    sock = _raw_dealer(b.endpoint)
    page_bytes = (1 << 40) if holdings["granted_pages"] == 1 << 40 else 4096
    reply = _hello(sock, "claim-nonce-1", page_bytes=min(page_bytes, 64 * GIB), holdings=holdings)
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
    from kvcached_broker.broker.server import BrokerServer, ServeConfig

    def serve():
        server = BrokerServer(ServeConfig(endpoint=f"ipc://{short_tmp}/r.sock", headroom="0",
                                          state_dir=short_tmp / "state"), SimulatedDevice(0, 8 * GIB))
        server.start()
        return server

    server = serve()
    sock = _raw_dealer(server.config.endpoint)

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
    sock = _raw_dealer(server.config.endpoint)
    claim = {**hello, "id": 3, "nonce": "resume-nonce-2", "resume": token, "holdings": {"granted_pages": 100}}
    reply = ask(claim)
    assert reply["ok"] and reply["result"]["holdings"]["granted_pages"] == 2  # 100 GiB do not fit in 8
    assert ask({**claim, "id": 4, "nonce": "resume-nonce-3", "holdings": {"granted_pages": 3}})["ok"]
    (session,) = server.ledger.sessions.values()
    assert session.granted_pages == 2  # a session resumed once adopts no more claims
    sock.close()
    server.close()


@pytest.mark.parametrize("depth", [200, 1000, 20_000])
def test_deeply_nested_frames_get_bad_request(inproc, depth):
    """msgpack nested 1,000 deep once killed the broker (a RecursionError in the decoder)."""
    sock = _raw_dealer(inproc.endpoint)
    for nested in (b"\x91" * depth + b"\x01", b"\x81\xa1k" * depth + b"\x01"):
        frame = b"\x83\xa2op\xa6status\xa2id\x07\xa1x" + nested  # an unknown field holds the nesting
        if len(frame) > proto.MAX_REQUEST_BYTES:
            continue
        sock.send(frame)
        reply = msgpack.unpackb(sock.recv())
        if depth >= 1000:
            assert reply["ok"] is False and reply["error"]["code"] == "bad_request"
        else:  # shallow enough to skip: a valid status request with an unknown field
            assert reply["ok"] is True and reply["id"] == 7
    assert inproc.status()["free_bytes"] == 80 * GIB  # alive, and nothing changed
    sock.close()


def test_a_request_id_is_answered_from_the_cache_only_for_the_same_body(inproc):
    sock = _raw_dealer(inproc.endpoint)
    token = _hello(sock, "cache-nonce-1")["result"]["session"]
    first = _ask(sock, {"op": "acquire", "id": 2, "session": token, "pages": 3})
    assert first["result"]["granted"] == 3
    assert _ask(sock, {"op": "acquire", "id": 2, "session": token, "pages": 3}) == first
    other = _ask(sock, {"op": "acquire", "id": 2, "session": token, "pages": 5})
    assert other["ok"] is False and other["error"]["code"] == "bad_request" and "different" in other["error"]["message"]
    assert inproc.status()["granted_bytes"] == 3 * 4096
    sock.close()


def test_a_request_id_older_than_the_reply_window_is_refused(inproc):
    sock = _raw_dealer(inproc.endpoint)
    token = _hello(sock, "window-nonce-1")["result"]["session"]
    window = inproc.server.table.reply_cache
    assert _ask(sock, {"op": "acquire", "id": 10, "session": token, "pages": 1})["ok"]
    for request_id in range(11, 11 + 3 * window):
        _ask(sock, {"op": "heartbeat", "id": request_id, "session": token})
    again = _ask(sock, {"op": "acquire", "id": 10, "session": token, "pages": 1})
    assert again["ok"] is False and again["error"]["code"] == "bad_request" and "window" in again["error"]["message"]
    assert inproc.status()["granted_bytes"] == 4096  # applied once
    sock.close()


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


def test_usage_views_larger_than_what_the_session_holds_are_refused(inproc):
    with connect(inproc, "views", page_bytes=256 * MIB) as c:
        assert c.acquire(2) == 2
        c.reserve({"kv_cache": GIB}, usage={"group0": GIB + 512 * MIB})  # the pool and the pages
        with pytest.raises(BadRequest, match="larger than what the session holds"):
            c.reserve({"kv_cache": GIB}, usage={"group0": 1 << 56})
        (inst,) = inproc.status()["instances"]
        assert inst["usage_breakdown"] == {"group0": GIB + 512 * MIB}


def test_reserve_pages_are_exact_in_status_as_soon_as_a_grant_is_answered(inproc):
    with connect(inproc, "credit", credit_pages=8, background=False) as c:
        assert c.acquire(3) == 3  # asks for 3 + 8: the 8 go to the reserve
        (session,) = inproc.status()["instances"][0]["sessions"]
        assert session["granted_pages"] == 11 and session["reserve_pages"] == 8 == c.reserve_pages
        assert c.acquire(20, min_pages=2) == 20
        (session,) = inproc.status()["instances"][0]["sessions"]
        assert session["reserve_pages"] == c.reserve_pages and session["granted_pages"] == 23 + c.reserve_pages
