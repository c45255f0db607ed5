"""client/results.py: every ok reply's result is read with the struct of its request.

The broker builds these structs and the client decodes each reply with its request's, so a
reply of another shape is one :class:`ProtocolError` line (the adapters take it as a broker
failure: ``DeviceSession.guard``), never a ``KeyError`` deep inside the client; and the wire
stays the maps docs/protocol.md gives (tests/test_protocol_doc.py reads them with plain msgpack).
"""

from __future__ import annotations

import msgspec
import pytest

from kvcached_broker.client import protocol as proto
from kvcached_broker.client import results


def _wire(result: msgspec.Struct) -> dict:
    """What a reply carrying ``result`` holds, as any MessagePack reader sees it."""
    return msgspec.msgpack.decode(proto.ok_reply(1, result))["result"]


def test_a_result_goes_on_the_wire_as_the_documented_map_with_unset_fields_left_out():
    acquired = results.AcquireResult(granted=0, granted_pages=3,
                                     refused=proto.ErrorBody(code="budget_exceeded", message="full"))
    assert _wire(acquired) == {"granted": 0, "granted_pages": 3,
                               "refused": {"code": "budget_exceeded", "message": "full", "details": {}}}
    assert _wire(results.ReleaseResult(granted_pages=2)) == {"granted_pages": 2}
    assert _wire(results.EvictResult(evicted="s-1", freed_bytes=5)) == {"evicted": "s-1", "killed": False,
                                                                         "freed_bytes": 5}
    hello = _wire(results.HelloResult(session="t" * 16, session_id="s-1", version=1, lease_s=8.0, heartbeat_s=2.0))
    assert hello["resumed"] is False and hello["claims"] is None and "hello_limits" not in hello
    assert hello["holdings"] == {"pools": {}, "granted_pages": 0, "reserve_pages": 0, "holds": {}, "mapped_pages": None}


def test_each_result_decodes_what_it_encodes_and_ignores_keys_it_does_not_know():
    sent = results.ReserveResult(pools={"w": 4}, holds={"kv": 1}, reserved_bytes=5, measured_bytes=0,
                                 grantable_bytes=2, ever_bytes=3,
                                 holders=[results.Holder(instance="b", charged_bytes=7)])
    assert results.decode(_wire(sent), results.ReserveResult) == sent
    assert results.decode({"granted": 1, "granted_pages": 1, "newer": "key"}, results.AcquireResult).granted == 1


@pytest.mark.parametrize("shape,result", [
    (results.AcquireResult, {"granted_pages": 3}),  # no "granted"
    (results.AcquireResult, {"granted": "2", "granted_pages": 3}),
    (results.ReserveResult, {"pools": [1, 2]}),
    # no "ever_bytes": a worker sizes its start-up from it, so it is never read as 0
    (results.ReserveResult, {"pools": {}, "holds": {}, "reserved_bytes": 0, "measured_bytes": 0, "grantable_bytes": 0}),
    (results.HelloResult, {"session_id": "s-1"}),  # no token
    (results.HelloResult, {"session": "t", "session_id": "s-1", "hello_limits": {"outcome": "granted"}}),
    (results.MappedResult, None),
])
def test_a_result_of_another_shape_is_one_protocol_error_line_the_adapters_take_as_a_broker_failure(shape, result):
    with pytest.raises(proto.ProtocolError) as caught:
        results.decode(result, shape)
    message = str(caught.value)
    assert message.startswith(f"the broker's answer is not a {shape.__name__}: ") and "\n" not in message


def test_the_status_document_is_checked_and_kept_as_the_map_it_came_as(broker_factory):
    from kvcached_broker.client.admin import AdminClient

    broker = broker_factory(simulate="4GiB")
    with AdminClient(broker.endpoint) as admin:
        status = admin.status()
    assert isinstance(status, dict) and results.checked_status(status) is status
    newer = {**status, "added_by_a_newer_broker": 1}
    assert results.checked_status(newer)["added_by_a_newer_broker"] == 1  # kept, not dropped
    for broken in ({**status, "instances": {}}, {k: v for k, v in status.items() if k != "budget_bytes"}, []):
        with pytest.raises(proto.ProtocolError, match="^the broker's answer is not a StatusDocument: "):
            results.checked_status(broken)


def test_an_older_brokers_status_with_only_the_contracts_fields_is_read(broker_factory):
    """docs/design.md's contract names the fields every broker sends; the rest were added since."""
    from helpers import connect

    from kvcached_broker.client.admin import AdminClient

    broker = broker_factory(simulate="4GiB")
    with connect(broker, "old") as client:
        client.reserve({"w": 1 << 30})
        with AdminClient(broker.endpoint) as admin:
            status = admin.status()
    contract = {"device", "total_bytes", "headroom_bytes", "external_bytes", "budget_bytes", "reserved_bytes",
                "granted_bytes", "unreported_bytes", "free_bytes", "overcommitted", "instances"}
    instance_fields = {"name", "max_bytes", "min_bytes", "reserved_bytes", "granted_bytes", "pools", "sessions"}
    session_fields = {"id", "rank", "tp_size", "pid", "state", "page_bytes", "granted_pages", "pools", "reserve_pages"}
    old = {k: v for k, v in status.items() if k in contract}
    old["instances"] = [{**{k: v for k, v in i.items() if k in instance_fields},
                         "sessions": [{k: v for k, v in s.items() if k in session_fields} for s in i["sessions"]]}
                        for i in status["instances"]]
    assert old["instances"][0]["sessions"] and results.checked_status(old) is old
    typed = results.decode(old, results.StatusDocument)
    assert typed.instances[0].sessions[0].phase == "" and typed.held_bytes == 0 and typed.broker == {}


def test_a_refusals_details_read_typed_and_details_of_another_shape_read_as_none_given(broker_factory):
    """What a real broker's refusal says reaches ``BudgetExceeded.refusal_details`` typed; details
    in another shape (an older or a newer broker) explain nothing rather than raise."""
    from helpers import GIB, connect

    from kvcached_broker.client import BudgetExceeded

    b = broker_factory(simulate="4GiB", extra_args=["--headroom", "0"])
    with connect(b, "big") as big, connect(b, "late") as late:
        big.reserve({"weights": 3 * GIB})
        with pytest.raises(BudgetExceeded) as refused:
            late.reserve({"kv": 2 * GIB})
    why = refused.value.refusal_details
    assert (why.instance, why.asked_bytes, why.free_bytes, why.pool) == ("late", 2 * GIB, GIB, "kv")
    assert [(h.instance, h.charged_bytes) for h in why.holders] == [("big", 3 * GIB)] and why.starting == []
    odd = BudgetExceeded("no room", details={"starting": "three", "asked_bytes": 1})
    assert odd.refusal_details == results.RefusalDetails()
