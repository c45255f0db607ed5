"""Hostile input: malformed, oversized, multipart, deeply nested and random frames, and tokens
the broker never issued, get an error (or nothing) and change nothing.

Decoding and the refusals are the request core's (driven directly, ``helpers.CoreSession``);
what only a socket can carry (oversized and multipart frames, thousands of random frames over
several connections) goes to a real broker.  The fuzzers (test_fuzz.py) drive the core too.
"""

from __future__ import annotations

import msgpack
import pytest
import zmq

from kvcached_broker.client import BrokerClient
from kvcached_broker.client import protocol as proto

from helpers import GIB, MIB, CoreConnection, CoreSession, connect, ledger_fingerprint, make_core, raw_dealer


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
def test_bad_frames_get_an_error_reply_and_change_nothing(frame):
    core = make_core(80 * GIB)
    c = CoreSession(core)
    c.acquire(2)
    before = ledger_fingerprint(core.ledger)
    reply = CoreConnection(core).ask(frame)
    assert reply["ok"] is False and reply["error"]["code"] == "bad_request"
    assert ledger_fingerprint(core.ledger) == before
    assert c.acquire(1) == 1  # the broker is still serving


@pytest.mark.parametrize(
    ("token", "code"),
    [("bad token!{}\n" * 2, "unknown_session"), ("é" * 10, "unknown_session"), ("short", "bad_request"), ("x" * 65, "bad_request")],
)
def test_a_token_the_broker_never_issued_is_refused_and_changes_nothing(token, code):
    core = make_core(80 * GIB)
    c = CoreSession(core)
    c.acquire(2)
    before = ledger_fingerprint(core.ledger)
    reply = CoreConnection(core).ask({"op": "acquire", "id": 1, "session": token, "pages": 1})
    assert reply["ok"] is False and reply["error"]["code"] == code and reply["id"] == 1
    assert ledger_fingerprint(core.ledger) == before and core.ledger.sessions[c.session_id].granted_pages == 2


def test_oversized_and_multipart_frames_do_not_hurt_the_broker(inproc):
    sock = raw_dealer(inproc.endpoint)
    sock.send(b"x" * (proto.MAX_REQUEST_BYTES + 10))  # ZeroMQ drops it and disconnects the peer
    sock.send_multipart([b"a", b"b"])
    with connect(inproc) as c:
        assert c.acquire(1) == 1
    sock.close()


NESTING_DEPTHS = [200, 1000, 20_000]


def nested_status_frames(depth: int):
    """Status requests (id 7) whose unknown field holds a list, or a map, nested ``depth`` deep;
    those a socket would carry (within ``MAX_REQUEST_BYTES``)."""
    for nested in (b"\x91" * depth + b"\x01", b"\x81\xa1k" * depth + b"\x01"):
        frame = b"\x83\xa2op\xa6status\xa2id\x07\xa1x" + nested
        if len(frame) <= proto.MAX_REQUEST_BYTES:
            yield frame


def assert_answered_safely(reply: dict) -> None:
    """What a nested frame may get: the status it asks for (the unknown field skipped) or
    ``bad_request`` (the decoder would not descend that deep), never ``internal``.  Which of
    the two at a given depth is the decoder's and the interpreter's choice (msgspec refuses
    1,000 levels on Python 3.11 and skips them on 3.12), not a property of the broker."""
    if reply["ok"]:
        assert reply["id"] == 7 and reply["result"]["budget_bytes"] > 0, reply
    else:
        assert reply["error"]["code"] == "bad_request" and "\n" not in reply["error"]["message"], reply


@pytest.mark.parametrize("depth", NESTING_DEPTHS)
def test_deeply_nested_frames_are_answered_and_change_nothing(depth):
    """msgpack nested 1,000 deep once killed the broker (a RecursionError in the decoder)."""
    core = make_core(80 * GIB)
    c = CoreSession(core)
    c.acquire(2)
    before = ledger_fingerprint(core.ledger)
    conn = CoreConnection(core)
    for frame in nested_status_frames(depth):
        assert_answered_safely(conn.ask(frame))
    assert ledger_fingerprint(core.ledger) == before
    assert c.acquire(1) == 1  # still serving


def test_deeply_nested_frames_never_stop_a_real_broker(broker):
    sock = raw_dealer(broker.endpoint)
    for depth in NESTING_DEPTHS:
        for frame in nested_status_frames(depth):
            sock.send(frame)
            assert_answered_safely(msgpack.unpackb(sock.recv()))
    sock.close()
    with BrokerClient.connect("after-nesting", endpoint=broker.endpoint, credit_pages=0) as c:
        assert c.acquire(3) == 3


def test_random_garbage_at_a_real_broker_socket(broker):
    """Thousands of random frames, some oversized, some multipart, over several connections."""
    import random

    rng = random.Random(42)
    with BrokerClient.connect("bystander", endpoint=broker.endpoint, credit_pages=0) as c:
        c.reserve({"weights": GIB})
        c.acquire(7)
        before = broker.status()
        socks = [raw_dealer(broker.endpoint) for _ in range(4)]
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

