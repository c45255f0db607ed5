"""Coverage-guided fuzzing of the broker's request path with atheris (libFuzzer).

    python tests/fuzz_atheris.py -runs=20000 -max_len=512

Each input is one request frame.  The dispatcher must always produce a well-formed reply,
never an internal error, and a rejected input must leave the ledger as it was.  Any failed
assertion is a crash, which libFuzzer reports with the input that caused it.
"""

from __future__ import annotations

import os
import sys

import atheris

with atheris.instrument_imports(include=["kvcached_broker"]):
    import msgspec

    from kvcached_broker.broker.security import Peer
    from kvcached_broker.client import protocol as proto

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import make_core  # the request core alone: no sockets, files or processes

PEER = Peer(uid=os.getuid(), gid=os.getgid(), pid=os.getpid(), address="localhost")
RID = b"\x00fuzz"
CORE = make_core(8 << 30, is_admin=lambda peer: True)
_hello = proto.Hello(id=1, versions=[1], instance="fuzz", pid=os.getpid(), page_bytes=1 << 20, nonce="atheris-nonce")
TOKEN = proto.decode_broker_message(CORE.handle(RID, PEER, proto.encode(_hello), 0.0)).result["session"]


def fingerprint():
    led = CORE.ledger
    return led.reserved_bytes, led.granted_bytes, len(led.sessions), {sid: s.granted_pages for sid, s in led.sessions.items()}


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    if fdp.ConsumeBool():  # structured: a real-looking request with fuzzed fields
        op = fdp.PickValueInList(["reserve", "acquire", "release", "heartbeat", "status", "limit", "hello", "evict"])
        message = {"op": op, "id": fdp.ConsumeIntInRange(0, 1 << 40), "session": TOKEN,
                   "pages": fdp.ConsumeIntInRange(-5, 1 << 45), "min_pages": fdp.ConsumeIntInRange(-1, 100),
                   "pools": {fdp.ConsumeUnicodeNoSurrogates(8): fdp.ConsumeIntInRange(-1, 1 << 40)},
                   "instance": fdp.ConsumeUnicodeNoSurrogates(12), "max_bytes": fdp.ConsumeIntInRange(0, 1 << 40)}
        frame = msgspec.msgpack.encode(message)
    else:
        frame = fdp.ConsumeBytes(fdp.remaining_bytes())
    before = fingerprint()
    raw = CORE.handle(RID, PEER, frame, 1.0)
    reply = msgspec.msgpack.decode(raw, type=proto.Reply)
    if not reply.ok:
        assert reply.error is not None and reply.error.code != "internal", reply.error
        assert fingerprint() == before
    CORE.ledger.check_invariant()


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
