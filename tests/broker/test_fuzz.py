"""Fuzz the decoder and the dispatcher with Hypothesis (bounded budget).

Every input must get a well-formed reply, never an internal error, and a rejected input must
leave the ledger exactly as it was.  ``FUZZ_EXAMPLES`` raises the budget for a longer run.

Every example gets a request core of its own (``fuzzed_core``, well under a millisecond): an
example's outcome depends on nothing an earlier one did, so a failure shrinks and replays
the same way whatever Hypothesis version chose the examples, and in whatever order.
"""

from __future__ import annotations

import os

import msgpack
import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcached_broker.broker.security import Peer
from kvcached_broker.client import protocol as proto

from helpers import GIB, make_core

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "400"))
FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
PEER = Peer(uid=os.getuid(), gid=os.getgid(), pid=os.getpid(), address="localhost")
RID = b"\x00fuzz"
COUNTS = {"bytes": 0, "structured": 0}


def fuzzed_core():
    """The request core alone: no sockets, files or processes (admin ops allowed, as for root),
    with one session holding a pool and pages; the core and that session's token."""
    core = make_core(8 * GIB, is_admin=lambda peer: True)
    hello = proto.encode(proto.Hello(id=1, versions=[1], instance="fuzz", pid=os.getpid(), page_bytes=1 << 20,
                                     nonce="fuzz-nonce-0"))
    reply = proto.decode_broker_message(core.handle(RID, PEER, hello, 0.0))
    assert reply.ok
    token = reply.result["session"]
    core.handle(RID, PEER, proto.encode(proto.Reserve(id=2, session=token, pools={"weights": GIB})), 0.0)
    core.handle(RID, PEER, proto.encode(proto.Acquire(id=3, session=token, pages=10)), 0.0)
    return core, token


def fingerprint(core):
    led = core.ledger
    return (
        led.reserved_bytes, led.granted_bytes, len(led.sessions), dict(led.limits),
        {sid: (dict(s.pools), s.granted_pages) for sid, s in led.sessions.items()},
    )


def check_reply(raw: bytes) -> proto.Reply:
    reply = msgspec.msgpack.decode(raw, type=proto.Reply)
    if not reply.ok:
        assert reply.error is not None and reply.error.code != "internal", reply.error
        assert "\n" not in reply.error.message
    return reply


@FUZZ_SETTINGS
@given(st.binary(max_size=512))
def test_random_bytes_never_crash_and_never_change_the_ledger(frame):
    COUNTS["bytes"] += 1
    core, _ = fuzzed_core()
    before = fingerprint(core)
    reply = core.handle(RID, PEER, frame, 1.0)
    if reply is not None:
        decoded = check_reply(reply)
        if not decoded.ok:
            assert fingerprint(core) == before
    core.ledger.check_invariant()


values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1) | st.floats()
    | st.text(max_size=40) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)
FIELDS = ["id", "session", "pages", "min_pages", "pools", "instance", "pid", "versions", "page_bytes", "nonce",
          "tp_rank", "tp_size", "resume", "holdings", "max_bytes", "min_bytes", "weight", "session_id", "kill",
          "external_bytes", "reserve_pages", "revision"]


@st.composite
def requests(draw):
    """A request map and whether it should carry the example's session token (the token is
    the example's own core's, so the test puts it in)."""
    message = {"op": draw(st.sampled_from(["hello", "reserve", "acquire", "release", "heartbeat", "close", "status",
                                           "limit", "evict", "simulate", "bogus"]))}
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=8, unique=True)):
        message[name] = draw(values)
    with_session = draw(st.booleans())
    if draw(st.booleans()):
        message["id"] = draw(st.integers(min_value=0, max_value=1 << 40))
    return message, with_session


@FUZZ_SETTINGS
@given(requests())
def test_structured_garbage_gets_an_error_or_a_valid_effect(request):
    COUNTS["structured"] += 1
    message, with_session = request
    core, token = fuzzed_core()
    if with_session:
        message["session"] = token
    try:
        frame = msgpack.packb(message, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return
    before = fingerprint(core)
    raw = core.handle(RID, PEER, frame, 2.0)
    reply = check_reply(raw)
    if not reply.ok:
        assert fingerprint(core) == before, message
    core.ledger.check_invariant()
    assert core.ledger.charged_bytes <= core.ledger.budget_bytes or core.ledger.overcommitted


EXTREMES = [0, 1, -1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 40, (1 << 56) + 1, (1 << 63) - 1, 1 << 63,
            (1 << 64) - 1, -(1 << 63)]
INT_FIELDS = ["id", "pages", "min_pages", "pid", "page_bytes", "tp_rank", "tp_size", "max_bytes", "min_bytes",
              "external_bytes", "reserve_pages", "revision"]


@st.composite
def nested(draw):
    """A value nested ``depth`` deep in lists or maps: a recursion bomb for a naive decoder."""
    depth = draw(st.integers(min_value=1, max_value=30_000))
    opener = draw(st.sampled_from([b"\x91", b"\x81\xa1k", b"\xdd\x00\x00\x00\x01"]))
    return opener * min(depth, proto.MAX_REQUEST_BYTES // (len(opener) + 1)) + b"\xc0"


@FUZZ_SETTINGS
@given(st.sampled_from(["hello", "reserve", "acquire", "release", "status", "limit", "simulate"]),
       st.sampled_from(FIELDS + ["x"]), nested())
def test_nesting_at_any_depth_gets_a_reply(op, field, bomb):
    COUNTS["nested"] = COUNTS.get("nested", 0) + 1
    core, token = fuzzed_core()
    head = msgpack.packb({"op": op, "id": 9, "session": token})
    frame = bytes([head[0] + 1]) + head[1:] + msgpack.packb(field) + bomb  # one more map entry, the bomb
    before = fingerprint(core)
    reply = check_reply(core.handle(RID, PEER, frame, 3.0))
    if not reply.ok:
        assert fingerprint(core) == before
    check_reply(core.handle(RID, PEER, proto.encode(proto.Status(id=10)), 3.0))  # status still answers


@FUZZ_SETTINGS
@given(st.sampled_from(["hello", "reserve", "acquire", "release", "limit", "simulate"]),
       st.dictionaries(st.sampled_from(INT_FIELDS), st.sampled_from(EXTREMES), min_size=1, max_size=6),
       st.booleans())
def test_integer_extremes_never_break_the_ledger_or_status(op, ints, claim):
    """Whatever integers a request carries: a refusal changes nothing, the ledger's totals stay
    exact, status agrees with them, and only a change in what the device reports (``simulate
    external_bytes``, an admin's testing aid) may take charges past the budget: no grant,
    reservation, hello or limit does."""
    COUNTS["extremes"] = COUNTS.get("extremes", 0) + 1
    core, token = fuzzed_core()
    message = {"op": op, "session": token, "instance": "fuzz", "versions": [1], "nonce": "fuzz-nonce-x", **ints}
    message.setdefault("id", 11)
    if claim:
        message["holdings"] = {"granted_pages": ints.get("pages", 1 << 40), "pools": {"w": ints.get("max_bytes", 1)}}
    try:
        frame = msgpack.packb(message)
    except (OverflowError, ValueError):
        return
    before = fingerprint(core)
    reply = check_reply(core.handle(RID, PEER, frame, 4.0))
    if not reply.ok:
        assert fingerprint(core) == before, message
    core.ledger.check_invariant()
    status = check_reply(core.handle(RID, PEER, proto.encode(proto.Status(id=12)), 4.0))
    assert status.ok, status.error
    doc = status.result
    charged = doc["reserved_bytes"] + doc["granted_bytes"] + doc["unreported_bytes"]
    assert doc["free_bytes"] == max(0, doc["budget_bytes"] - charged), doc
    assert doc["overcommitted"] == (charged > doc["budget_bytes"]), doc
    if op != "simulate":
        assert not doc["overcommitted"], message


def test_fuzz_budget_was_spent():
    """Runs last in this file: proves the fuzzers above actually ran their examples."""
    assert all(COUNTS.get(kind, 0) >= min(EXAMPLES, 100) for kind in ("bytes", "structured", "nested", "extremes")), COUNTS
    print(f"fuzz cases: {COUNTS}")


def test_coverage_guided_fuzzing_with_atheris():
    """libFuzzer-driven inputs (bounded runs); any crash or failed assertion fails the test."""
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    pytest.importorskip("atheris")
    runs = int(os.environ.get("ATHERIS_RUNS", "50000"))
    target = Path(__file__).resolve().parents[1] / "fuzz_atheris.py"
    out = subprocess.run([sys.executable, str(target), f"-runs={runs}", "-max_len=512", "-seed=1"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"Done {runs} runs" in out.stderr
