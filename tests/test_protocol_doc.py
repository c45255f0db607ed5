"""A client written from docs/protocol.md alone: plain ``zmq`` and ``msgpack``, no project code.

Each test starts a real broker subprocess on a simulated GPU (the ``broker_factory`` fixture)
and speaks the wire protocol as the document specifies it: a DEALER socket, one MessagePack map
per frame, replies matched by id, pushes set aside.  Every wait is on a reply, a push or a
socket event; the timeouts only bound a failure.
"""

from __future__ import annotations

import itertools
import os
import re
import time

import msgpack
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

GIB = 1 << 30
MIB = 1 << 20
ATTEMPT_S = 1.0  # resend identical bytes after this long without the reply (§7)
TOTAL_S = 60.0  # then give up (a failure here: generous, so a loaded machine does not fail it)
MAX_REQUEST_BYTES = 65536  # §1
TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{8,64}$")
SESSION_ID_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


# ----------------------------------------------------------------- the client
class Connection:
    """One DEALER connection to the broker (§1): replies matched by id, pushes kept aside."""

    def __init__(self, endpoint: str, *, monitor: bool = False):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self.sock.setsockopt(zmq.RECONNECT_IVL, 50)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        events = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
        self.monitor = self.sock.get_monitor_socket(events) if monitor else None
        self.sock.connect(endpoint)
        self.pushes: list[dict] = []

    def send_frame(self, frame: bytes, deadline: float) -> None:
        """Queue one frame; with IMMEDIATE, wait for a connection first."""
        while True:
            try:
                self.sock.send(frame, zmq.NOBLOCK)
                return
            except zmq.Again:
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                assert remaining_ms > 0, "no connection to the broker"
                self.sock.poll(min(remaining_ms, 50), zmq.POLLOUT)

    def receive(self, timeout_s: float) -> tuple[dict, bytes] | None:
        """The next broker message within ``timeout_s``, or None."""
        if not self.sock.poll(max(1, int(timeout_s * 1000)), zmq.POLLIN):
            return None
        raw = self.sock.recv()
        return msgpack.unpackb(raw), raw

    def request(self, message: dict, *, frame: bytes | None = None) -> tuple[dict, bytes]:
        """Send ``message`` (or the exact ``frame``) and return its reply and the reply's bytes.

        Without an answer the same bytes go out again (§7); replies to other ids are late or
        duplicate answers and are dropped; pushes are kept in ``pushes``.
        """
        frame = msgpack.packb(message) if frame is None else frame
        deadline = time.monotonic() + TOTAL_S
        while True:
            self.send_frame(frame, deadline)
            attempt_end = min(deadline, time.monotonic() + ATTEMPT_S)
            while (remaining := attempt_end - time.monotonic()) > 0:
                got = self.receive(remaining)
                if got is None:
                    break
                reply, raw = got
                if reply.get("type") == "reply" and reply.get("id") == message["id"]:
                    return reply, raw
                if reply.get("type") == "pressure":
                    self.pushes.append(reply)
            assert time.monotonic() < deadline, f"no reply to {message.get('op')} id {message['id']}"

    def wait_push(self, timeout_s: float = TOTAL_S) -> dict:
        deadline = time.monotonic() + timeout_s
        while not self.pushes:
            got = self.receive(deadline - time.monotonic())
            assert got is not None, "no push arrived"
            if got[0].get("type") == "pressure":
                self.pushes.append(got[0])
        return self.pushes.pop(0)

    def wait_reconnected(self, timeout_s: float = TOTAL_S) -> None:
        """Wait until the broker drops this connection and the DEALER's new one is up."""
        assert self.monitor is not None
        deadline = time.monotonic() + timeout_s
        for wanted in (zmq.EVENT_DISCONNECTED, zmq.EVENT_HANDSHAKE_SUCCEEDED):
            while True:
                assert self.monitor.poll(max(1, int((deadline - time.monotonic()) * 1000))), f"no event {wanted}"
                if recv_monitor_message(self.monitor)["event"] == wanted:
                    break

    def close(self) -> None:
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(0)
        self.sock.close(0)


class Session:
    """A session's client side: one strictly increasing id counter (§6), the token (§8)."""

    def __init__(self, conn: Connection, instance: str, page_bytes: int):
        self.conn = conn
        self.instance = instance
        self.page_bytes = page_bytes
        self.ids = itertools.count(1)
        self.token: str | None = None
        self.session_id: str | None = None
        self.nonces = itertools.count(1)

    def hello_message(self, **extra) -> dict:
        return {
            "op": "hello", "id": next(self.ids), "versions": [1], "instance": self.instance,
            "pid": os.getpid(), "page_bytes": self.page_bytes,
            "nonce": f"{self.instance}-n{next(self.nonces)}-{os.getpid()}", "client": "protocol-doc-test", **extra,
        }

    def hello(self, **extra) -> dict:
        reply, _ = self.conn.request(self.hello_message(**extra))
        assert reply["ok"] is True, reply
        result = reply["result"]
        self.token, self.session_id = result["session"], result["session_id"]
        return result

    def message(self, op: str, **fields) -> dict:
        return {"op": op, "id": next(self.ids), "session": self.token, **fields}

    def call(self, op: str, **fields) -> dict:
        return self.conn.request(self.message(op, **fields))[0]

    def ok(self, op: str, **fields) -> dict:
        reply = self.call(op, **fields)
        assert reply["ok"] is True, reply
        return reply["result"]


def split_grant(reserve: int, granted: int, pages: int, min_pages: int | None) -> tuple[int, int]:
    """§10, as the document states it."""
    floor = pages if min_pages is None else min_pages
    available = reserve + granted
    give = min(pages, available)
    if give < floor or give == 0:
        give = 0
    return give, available - give


def status(conn: Connection, request_id: int, **fields) -> dict:
    reply, _ = conn.request({"op": "status", "id": request_id, **fields})
    assert reply["ok"] is True, reply
    check_invariants(reply["result"])
    return reply["result"]


def check_invariants(doc: dict) -> None:
    """The status document's invariants (§13)."""
    assert doc["budget_bytes"] == max(0, doc["total_bytes"] - doc["headroom_bytes"] - doc["external_bytes"])
    charged = doc["reserved_bytes"] + doc["granted_bytes"] + doc["unreported_bytes"]
    assert doc["free_bytes"] == max(0, doc["budget_bytes"] - charged)
    assert doc["overcommitted"] is (charged > doc["budget_bytes"])
    assert 0 <= doc["held_bytes"] <= doc["reserved_bytes"]
    instances = doc["instances"]
    assert [i["name"] for i in instances] == sorted(i["name"] for i in instances)
    for key in ("reserved_bytes", "granted_bytes", "unreported_bytes", "held_bytes"):
        assert doc[key] == sum(i[key] for i in instances), key
    for inst in instances:
        sessions = inst["sessions"]
        assert inst["reserved_bytes"] == sum(s["reserved_bytes"] for s in sessions)
        assert inst["granted_bytes"] == sum(s["granted_bytes"] for s in sessions)
        assert inst["charged_bytes"] == inst["reserved_bytes"] + inst["granted_bytes"] + inst["unreported_bytes"]
        assert sum(inst["pools"].values()) == inst["reserved_bytes"]
        assert [(s["rank"], s["id"]) for s in sessions] == sorted((s["rank"], s["id"]) for s in sessions)
        for s in sessions:
            assert s["granted_bytes"] == s["granted_pages"] * s["page_bytes"]
            assert 0 <= s["reserve_pages"] <= s["granted_pages"]
            assert sum(s["pools"].values()) == s["reserved_bytes"]
            assert all(s["pools"][name] == size for name, size in s["holds"].items())
            assert sum(s["holds"].values()) == s["held_bytes"]
            assert s["state"] in ("live", "stale", "recovering")
    assert doc["broker"]["protocol"] == 1


def session_view(doc: dict, session_id: str) -> dict:
    (found,) = [s for i in doc["instances"] for s in i["sessions"] if s["id"] == session_id]
    return found


def assert_error(reply: dict, code: str) -> dict:
    assert reply["type"] == "reply" and reply["ok"] is False, reply
    error = reply["error"]
    assert set(error) == {"code", "message", "details"} and isinstance(error["message"], str), error
    assert error["code"] == code, error
    return error


@pytest.fixture
def sim_broker(broker_factory):
    return broker_factory(simulate="8GiB")


# ------------------------------------------------------------------ the tests
def test_a_session_from_hello_to_close(sim_broker):
    conn = Connection(sim_broker.endpoint)
    page = 2 * MIB
    w = Session(conn, "doc-a", page)
    hello = w.hello()
    assert TOKEN_RE.match(hello["session"]) and SESSION_ID_RE.match(hello["session_id"])
    assert hello["session"] != hello["session_id"]
    assert hello["version"] == 1 and hello["resumed"] is False and hello["pid_verified"] is True
    assert hello["heartbeat_s"] == hello["lease_s"] / 4
    assert hello["device"]["simulated"] is True
    assert hello["holdings"] == {"pools": {}, "granted_pages": 0, "reserve_pages": 0, "holds": {}, "mapped_pages": 0}
    before = status(conn, next(w.ids))
    budget = before["budget_bytes"]

    # Pools and a hold; an unknown field is ignored (§2).
    result = w.ok("reserve", pools={"weights": GIB, "kv_static": 512 * MIB}, holds={"kv_sizing_hold": 256 * MIB},
                  from_a_newer_client={"ignored": [1, 2]})
    assert result["pools"] == {"weights": GIB, "kv_static": 512 * MIB}
    assert result["holds"] == {"kv_sizing_hold": 256 * MIB}
    assert result["reserved_bytes"] == GIB + 768 * MIB
    doc = status(conn, next(w.ids))
    assert doc["held_bytes"] == 256 * MIB and doc["reserved_bytes"] == GIB + 768 * MIB
    mine = session_view(doc, w.session_id)
    assert mine["pools"]["kv_sizing_hold"] == 256 * MIB and mine["state"] == "live"
    # The hold turns into its pool in one request.
    result = w.ok("reserve", pools={"weights": GIB, "kv_static": 768 * MIB}, holds={})
    assert result["holds"] == {} and result["reserved_bytes"] == GIB + 768 * MIB

    # A grant shared between the caller and the client's reserve (§10).
    ask = w.message("acquire", pages=24, min_pages=8, reserve_pages=0, caller_pages=16, caller_min_pages=8)
    frame = msgpack.packb(ask)
    reply, raw = conn.request(ask, frame=frame)
    assert reply["ok"] is True and reply["result"] == {"granted": 24, "granted_pages": 24}
    _, reserve_after = split_grant(0, 24, 16, 8)
    doc = status(conn, next(w.ids))
    assert session_view(doc, w.session_id)["reserve_pages"] == reserve_after == 8
    assert doc["granted_bytes"] == 24 * page

    # The same id with the same bytes: the first reply again, nothing applied twice (§6).
    again, raw_again = conn.request(ask, frame=frame)
    assert raw_again == raw
    assert status(conn, next(w.ids))["granted_bytes"] == 24 * page
    # The same id with a different body: bad_request, and nothing applied.
    reply, _ = conn.request({**ask, "pages": 25})
    error = assert_error(reply, "bad_request")
    assert error["details"] == {"id": ask["id"]} and "already used for a different request" in error["message"]
    assert status(conn, next(w.ids))["granted_bytes"] == 24 * page

    # A refusal is not an error (§4).
    refused = w.ok("acquire", pages=1 << 20)
    assert refused["granted"] == 0 and refused["granted_pages"] == 24
    assert refused["refused"]["code"] == "budget_exceeded"
    assert refused["refused"]["details"]["pool"] == "elastic"

    # Releasing more than held: the documented body; that id stays unused.
    too_many = w.message("release", pages=25)
    error = assert_error(conn.request(too_many)[0], "bad_request")
    assert error["details"] == {"pages": 25, "granted_pages": 24}
    assert status(conn, next(w.ids))["granted_bytes"] == 24 * page
    reply, _ = conn.request({**too_many, "pages": 4, "reserve_pages": 4})
    assert reply["ok"] is True and reply["result"] == {"granted_pages": 20}

    # Heartbeat (§9).
    beat = w.ok("heartbeat", reserve_pages=4)
    assert beat == {"state": "live", "granted_pages": 20}
    assert session_view(status(conn, next(w.ids)), w.session_id)["reserve_pages"] == 4

    # An unknown token, and a real token from another connection (§8).
    assert assert_error(w.conn.request({"op": "heartbeat", "id": next(w.ids), "session": "not-a-token-0000"})[0],
                        "unknown_session")["details"] == {}
    other = Connection(sim_broker.endpoint)
    error = assert_error(other.request({"op": "acquire", "id": 1, "session": w.token, "pages": 1})[0], "not_owner")
    assert error["details"] == {"session_id": w.session_id, "resume": True}
    other.close()

    # Close frees everything; a second close finds no session.
    charged = session_view(status(conn, next(w.ids)), w.session_id)
    closed = w.ok("close")
    assert closed == {"closed": w.session_id, "freed_bytes": charged["reserved_bytes"] + charged["granted_bytes"]}
    after = status(conn, next(w.ids))
    assert after["reserved_bytes"] == after["granted_bytes"] == 0
    assert after["free_bytes"] == budget == before["free_bytes"]
    assert all(s["id"] != w.session_id for i in after["instances"] for s in i["sessions"])
    assert_error(w.call("close"), "unknown_session")
    conn.close()


def test_framing_validation_the_reply_window_and_resume(sim_broker):
    conn = Connection(sim_broker.endpoint, monitor=True)
    w = Session(conn, "doc-b", MIB)
    w.hello()

    # Validation (§2): wrong types are bad_request, the id salvaged where it can be read.
    error = assert_error(w.call("acquire", pages=1.0), "bad_request")
    assert error["message"].startswith("invalid request:") and error["details"] == {}
    reply, _ = conn.request({"op": "status", "id": 7, "session": b"bytes-are-not-strings"})
    assert_error(reply, "bad_request")
    reply, _ = conn.request({"op": "no-such-op", "id": 8})
    assert_error(reply, "bad_request")
    # A message of two frames: bad_request with id nil (§1).
    conn.sock.send_multipart([msgpack.packb({"op": "status", "id": 9}), b"more"])
    reply, _ = conn.receive(TOTAL_S)
    assert reply["id"] is None and assert_error(reply, "bad_request")["message"] == "a request is exactly one frame"

    # Exactly 64 KiB is accepted (an unknown field pads it).
    probe = {"op": "status", "id": next(w.ids), "pad": ""}
    probe["pad"] = "x" * (MAX_REQUEST_BYTES - len(msgpack.packb(probe)) - 2)
    frame = msgpack.packb(probe)
    assert len(frame) == MAX_REQUEST_BYTES
    assert conn.request(probe, frame=frame)[0]["ok"] is True

    # The reply window (§6): ids beyond the last 256..512 cached replies are refused.
    assert w.ok("acquire", pages=3)["granted"] == 3
    first_beat = w.message("heartbeat")
    assert conn.request(first_beat)[0]["ok"] is True
    for _ in range(520):
        assert w.call("heartbeat")["ok"] is True
    error = assert_error(conn.request(first_beat)[0], "bad_request")
    assert error["details"]["id"] == first_beat["id"] and error["details"]["forgotten_id"] >= first_beat["id"]

    # One byte over 64 KiB: no reply, the connection is dropped; the reconnected DEALER is a
    # new connection, so the session must be resumed (§1, §8).
    kept = w.message("release", pages=1)
    kept_reply, kept_raw = conn.request(kept)
    assert kept_reply["result"] == {"granted_pages": 2}
    conn.send_frame(frame + b"\x00", time.monotonic() + TOTAL_S)
    conn.wait_reconnected()
    assert_error(w.call("heartbeat"), "not_owner")
    resumed = w.hello(resume=w.token, holdings={"granted_pages": 2})
    assert resumed["resumed"] is True and resumed["holdings"]["granted_pages"] == 2
    # A resend of an answered request, from the new connection: the cached reply.
    assert conn.request(kept)[1] == kept_raw
    assert session_view(status(conn, next(w.ids)), w.session_id)["granted_pages"] == 2
    w.ok("close")
    conn.close()


def test_pressure_push_and_eviction(sim_broker):
    a_conn, b_conn = Connection(sim_broker.endpoint), Connection(sim_broker.endpoint)
    a, b = Session(a_conn, "doc-big", GIB), Session(b_conn, "doc-small", GIB)
    a.hello()
    b.hello()
    budget_pages = status(a_conn, next(a.ids))["budget_bytes"] // GIB
    assert a.ok("acquire", pages=100, min_pages=1)["granted"] == budget_pages  # the largest fit
    refused = b.ok("acquire", pages=2)
    assert refused["granted"] == 0 and refused["refused"]["code"] == "budget_exceeded"

    # b is below its fair share and a above: a is asked for pages back (§11).
    push = a_conn.wait_push()
    assert push["type"] == "pressure" and push["session_id"] == a.session_id
    assert 1 <= push["pages"] <= budget_pages
    assert a.ok("release", pages=push["pages"])["granted_pages"] == budget_pages - push["pages"]
    doc = status(a_conn, next(a.ids))
    (big,) = [i for i in doc["instances"] if i["name"] == "doc-big"]
    assert big["pressure"]["returned_bytes"] == push["pages"] * GIB
    assert b.ok("acquire", pages=2, min_pages=1)["granted"] >= 1

    # Eviction fences the token (§12): every later request, a resume included, gets evicted.
    reply, _ = a_conn.request({"op": "evict", "id": next(a.ids), "session_id": b.session_id})
    assert reply["ok"] is True and reply["result"]["evicted"] == b.session_id and reply["result"]["killed"] is False
    assert_error(b.call("heartbeat"), "evicted")
    reply, _ = b_conn.request(b.hello_message(resume=b.token))
    assert_error(reply, "evicted")
    doc = status(a_conn, next(a.ids))
    assert all(s["id"] != b.session_id for i in doc["instances"] for s in i["sessions"])
    a.ok("close")
    assert status(a_conn, next(a.ids))["granted_bytes"] == 0
    a_conn.close()
    b_conn.close()
