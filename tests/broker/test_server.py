"""The requests of the client API and the status contract of docs/design.md.

What the broker decides (admission, partial grants, refusals, usage views, the reply cache,
the status document) is driven through the request core directly (``helpers.CoreSession``:
MessagePack frames in, replies out, no socket).  What needs a real client or the wire stays
on real sockets against an in-process broker: the client's credit reserve and its
background, closing twice, and a plain msgpack client over ZeroMQ.
"""

from __future__ import annotations

import os

from helpers import GIB, MIB, CoreSession, connect, make_core, raw_ask, raw_dealer, wait_for


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


def test_status_document_has_the_contract_shape():
    c = CoreSession(make_core(80 * GIB), "dsv4")
    c.result("reserve", pools=DSV4_POOLS)
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


def test_second_instance_fills_the_gpu_to_the_last_page_and_every_byte_matches():
    core = make_core(80 * GIB, headroom="4GiB")
    v4, filler = CoreSession(core, "dsv4"), CoreSession(core, "filler", page_bytes=2 * MIB)
    v4.result("reserve", pools=DSV4_POOLS)
    assert v4.acquire(100) == 100
    budget = v4.status()["budget_bytes"]
    free = budget - sum(DSV4_POOLS.values()) - 100 * 2 * MIB
    last_page = free // (2 * MIB)
    assert filler.acquire(last_page + 1) == 0  # all-or-nothing: one page too many
    assert filler.acquire(last_page) == last_page
    assert filler.acquire(1) == 0
    s = v4.status()
    assert s["free_bytes"] == free - last_page * 2 * MIB == 0
    assert s["granted_bytes"] == (100 + last_page) * 2 * MIB
    assert s["reserved_bytes"] == sum(DSV4_POOLS.values())
    by_name = {i["name"]: i for i in s["instances"]}
    assert by_name["filler"]["granted_bytes"] == last_page * 2 * MIB
    assert by_name["dsv4"]["pools"] == DSV4_POOLS
    filler.result("release", pages=1)
    assert filler.acquire(1) == 1


def test_partial_grant_with_min_pages():
    c = CoreSession(make_core(100 * MIB), page_bytes=10 * MIB)
    assert c.acquire(16, min_pages=4) == 10
    assert c.acquire(4, min_pages=1) == 0
    assert c.session.granted_pages == 10


def test_reserve_refusal_raises_budget_exceeded_naming_the_pool():
    c = CoreSession(make_core(8 * GIB))
    c.result("reserve", pools={"weights": 6 * GIB})
    refused = c.error("reserve", pools={"weights": 6 * GIB, "swa_kv_pool": 3 * GIB})
    assert refused["code"] == "budget_exceeded"  # the client raises BudgetExceeded for it
    assert "swa_kv_pool" in refused["message"] and refused["details"]["free_bytes"] == 2 * GIB
    assert c.status()["reserved_bytes"] == 6 * GIB
    assert c.result("reserve", pools={"weights": 6 * GIB, "swa_kv_pool": 0})["pools"] == {"weights": 6 * GIB}


def test_release_more_than_held_is_bad_request():
    c = CoreSession(make_core(80 * GIB))
    c.acquire(3)
    assert c.error("release", pages=4)["code"] == "bad_request"
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


def test_plain_msgpack_client_interoperates(inproc):
    sock = raw_dealer(inproc.endpoint)
    hello = raw_ask(sock, {
        "op": "hello", "id": 1, "versions": [1], "instance": "plain", "pid": os.getpid(),
        "page_bytes": 4096, "nonce": "plain-nonce-1",
    })
    assert hello["type"] == "reply" and hello["ok"] is True and hello["id"] == 1
    token = hello["result"]["session"]
    reply = raw_ask(sock, {"op": "reserve", "id": 2, "session": token, "pools": {"weights": 1 << 20}})
    assert reply["ok"] and reply["result"]["pools"] == {"weights": 1 << 20}
    reply = raw_ask(sock, {"op": "acquire", "id": 3, "session": token, "pages": 5})
    assert reply["result"]["granted"] == 5
    reply = raw_ask(sock, {"op": "release", "id": 4, "session": token, "pages": 9})
    assert reply["ok"] is False and reply["error"]["code"] == "bad_request"
    reply = raw_ask(sock, {"op": "acquire", "id": 3, "session": token, "pages": 5})  # a retry: cached
    assert reply["result"]["granted"] == 5
    assert inproc.ledger.sessions[hello["result"]["session_id"]].granted_pages == 5
    status = raw_ask(sock, {"op": "status", "id": 5})["result"]
    assert status["granted_bytes"] == 5 * 4096
    sock.close()


def test_usage_breakdown_is_shown_but_never_charged():
    c = CoreSession(make_core(80 * GIB), "vllm-like")
    c.result("reserve", pools={"kv_cache": 8 * GIB}, usage={"swa_kv_pool": 8 * GIB, "c4_kv_pool": 8 * GIB})
    s = c.status()
    inst = s["instances"][0]
    assert inst["name"] == "vllm-like"
    assert s["reserved_bytes"] == 8 * GIB  # one buffer, charged once
    assert inst["usage_breakdown"] == {"c4_kv_pool": 8 * GIB, "swa_kv_pool": 8 * GIB}
    assert inst["sessions"][0]["usage_breakdown"] == inst["usage_breakdown"]
    c.result("reserve", pools={"kv_cache": 8 * GIB})  # usage omitted: kept
    assert c.status()["instances"][0]["usage_breakdown"]["swa_kv_pool"] == 8 * GIB


def test_a_session_that_never_acquires_keeps_no_idle_credit(inproc):
    with connect(inproc, "reserver", credit_pages=16) as c:
        c.reserve({"weights": GIB})
        session = inproc.ledger.sessions[c.session_id]
        answered = session.last_seen_s
        # The background's next heartbeat comes after its reserve top-up in the same round and
        # on the same connection: once the broker has seen it, that round's top-up (if any) is in.
        wait_for(lambda: session.last_seen_s > answered, what="a background round's heartbeat")
        assert inproc.ledger.sessions[c.session_id].granted_pages == 0
        assert c.acquire(1) == 1
        assert inproc.ledger.sessions[c.session_id].granted_pages == 17  # now the reserve is in use


def test_a_request_id_is_answered_from_the_cache_only_for_the_same_body():
    c = CoreSession(make_core(80 * GIB), "claimer", page_bytes=4096)
    token = c.token
    first = c.ask({"op": "acquire", "id": 2, "session": token, "pages": 3})
    assert first["result"]["granted"] == 3
    assert c.ask({"op": "acquire", "id": 2, "session": token, "pages": 3}) == first
    other = c.ask({"op": "acquire", "id": 2, "session": token, "pages": 5})
    assert other["ok"] is False and other["error"]["code"] == "bad_request" and "different" in other["error"]["message"]
    assert c.status()["granted_bytes"] == 3 * 4096


def test_a_request_id_older_than_the_reply_window_is_refused():
    core = make_core(80 * GIB)
    c = CoreSession(core, "claimer", page_bytes=4096)
    token = c.token
    window = core.table.reply_cache
    assert c.ask({"op": "acquire", "id": 10, "session": token, "pages": 1})["ok"]
    for request_id in range(11, 11 + 3 * window):
        c.ask({"op": "heartbeat", "id": request_id, "session": token})
    again = c.ask({"op": "acquire", "id": 10, "session": token, "pages": 1})
    assert again["ok"] is False and again["error"]["code"] == "bad_request" and "window" in again["error"]["message"]
    assert c.status()["granted_bytes"] == 4096  # applied once


def test_usage_views_larger_than_what_the_session_holds_are_refused():
    c = CoreSession(make_core(80 * GIB), "views", page_bytes=256 * MIB)
    assert c.acquire(2) == 2
    c.result("reserve", pools={"kv_cache": GIB}, usage={"group0": GIB + 512 * MIB})  # the pool and the pages
    refused = c.error("reserve", pools={"kv_cache": GIB}, usage={"group0": 1 << 56})
    assert refused["code"] == "bad_request" and "larger than what the session holds" in refused["message"]
    (inst,) = c.status()["instances"]
    assert inst["usage_breakdown"] == {"group0": GIB + 512 * MIB}


def test_reserve_pages_are_exact_in_status_as_soon_as_a_grant_is_answered(inproc):
    with connect(inproc, "credit", credit_pages=8, background=False) as c:
        assert c.acquire(3) == 3  # asks for 3 + 8: the 8 go to the reserve
        (session,) = inproc.status()["instances"][0]["sessions"]
        assert session["granted_pages"] == 11 and session["reserve_pages"] == 8 == c.reserve_pages
        assert c.acquire(20, min_pages=2) == 20
        (session,) = inproc.status()["instances"][0]["sessions"]
        assert session["reserve_pages"] == c.reserve_pages and session["granted_pages"] == 23 + c.reserve_pages

