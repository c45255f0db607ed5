"""Promised memory over the wire: pages a session has not mapped yet, holds that shrink to fit,
and the start-up phase, through the client API against real brokers (and a restart).

The accounting is docs/accounting.md's: a process is charged ``max(measured, pools + mapped
pages) + holds + unmapped pages``; test_ledger.py checks the arithmetic, this file what a
worker sees of it.
"""

from __future__ import annotations

import os

import pytest

from helpers import GIB, MIB, CoreSession, connect, make_core, restarted_core, session_of

from kvcached_broker.client import BadRequest, BudgetExceeded
from kvcached_broker.client.admin import AdminClient

PID = os.getpid()


def _measure(b, size_bytes: int) -> None:
    """The simulated device now measures this process using ``size_bytes``."""
    with AdminClient(b.endpoint, timeout_s=30) as admin:
        admin.simulate(process_bytes={PID: size_bytes})


def test_a_session_that_reports_mapping_is_charged_for_every_page_it_has_not_mapped(broker_factory):
    b = broker_factory(simulate="4GiB", extra_args=["--headroom", "0"])
    _measure(b, GIB)  # weights and context
    with connect(b, "kv-a", report_mapping=True) as a:
        a.reserve({}, measured_base=True)
        assert a.acquire(512) == 512  # 1 GiB, nothing mapped yet
        assert a.mapped(296) == 216
        _measure(b, GIB + 296 * 2 * MIB + 384 * MIB)  # the pages it mapped, and 384 MiB of graphs
        status = b.status()
        me = session_of(status, a.session_id)
        assert me["report_mapping"] is True and me["unmapped_pages"] == 216 and me["granted_pages"] == 512
        assert status["free_bytes"] == 4 * GIB - GIB - 512 * 2 * MIB - 384 * MIB
        pages = status["free_bytes"] // (2 * MIB)  # everything not taken or promised, and no more:
        assert a.acquire(pages + 1) == 0 and a.acquire(pages) == pages  # the graphs' 384 MiB covers none
        a.release(pages)
        a.release(100, mapped_pages=196)  # unmapped 100 pages to give them back
        me = session_of(b.status(), a.session_id)
        assert me["granted_pages"] == 412 and me["unmapped_pages"] == 216 and a.mapped_pages == 196


def test_mapped_counts_are_checked_on_the_client_and_by_the_broker(broker):
    with connect(broker, "plain") as plain, connect(broker, "kv", report_mapping=True) as kv:
        plain.acquire(4)
        with pytest.raises(BadRequest, match="report_mapping=True"):
            plain.mapped(2)
        kv.acquire(4)
        with pytest.raises(BadRequest, match="must not exceed"):
            kv.mapped(5)
        with pytest.raises(BadRequest, match="must not exceed"):
            kv.release(1, mapped_pages=4)
        assert session_of(broker.status(), kv.session_id)["unmapped_pages"] == 4 and kv.held_pages == 4


def test_a_plain_msgpack_client_gets_bad_request_for_a_count_above_its_grant():
    core = make_core(8 * GIB)
    kv = CoreSession(core, "kv", report_mapping=True)
    assert kv.acquire(10) == 10
    error = kv.error("mapped", mapped_pages=11)
    assert error["code"] == "bad_request" and "between 0 and the 10" in error["message"]
    assert kv.result("mapped", mapped_pages=7) == {"granted_pages": 10, "unmapped_pages": 3}
    plain = CoreSession(core, "plain")
    assert plain.error("mapped", mapped_pages=0)["code"] == "bad_request"


def test_which_pages_are_mapped_survives_a_broker_restart(short_tmp):
    core = restarted_core(short_tmp, 8 * GIB)
    kv = CoreSession(core, "kv", report_mapping=True, nonce="nonce-mapped-1")
    kv.acquire(100)
    kv.result("mapped", mapped_pages=60)
    kv.result("reserve", pools={}, phase="serving")
    core.journal.commit(0.0)
    core.journal.flush()
    restarted = restarted_core(short_tmp, 8 * GIB)  # this process still runs: its session comes back
    (session,) = restarted.ledger.sessions.values()
    assert session.report_mapping and session.unmapped_pages == 40 and session.phase == "serving"
    restarted.ledger.check_invariant()


def test_a_hold_shrinks_to_what_fits_and_the_answer_says_the_room(broker_factory):
    b = broker_factory(simulate="8GiB", extra_args=["--headroom", "0"])
    with connect(b, "big") as other:
        other.reserve({"weights": 5 * GIB})
        with connect(b, "a") as a:
            a.reserve({}, holds={"runtime_slack_hold": GIB, "kv_sizing_hold": 4 * GIB},
                      min_holds={"kv_sizing_hold": GIB // 2}, phase="sizing")
            assert a.holds == {"runtime_slack_hold": GIB, "kv_sizing_hold": 2 * GIB}
            answer = a.last_reserve
            assert answer is not None and answer.grantable_bytes == 0  # the other instance has no floor: it could all come back
            assert answer.ever_bytes == 8 * GIB - 3 * GIB
            me = session_of(b.status(), a.session_id)
            assert me["phase"] == "sizing" and me["holds"] == a.holds
            with pytest.raises(BudgetExceeded) as refused:
                a.reserve({}, holds={"runtime_slack_hold": GIB, "kv_sizing_hold": 4 * GIB},
                          min_holds={"kv_sizing_hold": 3 * GIB})
            assert "held by big 5.00 GiB" in refused.value.message
            assert refused.value.details["holders"] == [{"instance": "big", "charged_bytes": 5 * GIB}]
            assert a.holds["kv_sizing_hold"] == 2 * GIB  # a refusal changes nothing


@pytest.mark.parametrize("min_holds, match", [
    ({"kv_sizing_hold": GIB, "other": 1}, "one hold"),
    ({"other": 1}, "does not ask for"),
    ({"kv_sizing_hold": 3 * GIB}, "must not exceed"),
])
def test_min_holds_are_checked_before_anything_is_sent(broker, min_holds, match):
    with connect(broker, "a") as a:
        with pytest.raises(BadRequest, match=match):
            a.reserve({}, holds={"kv_sizing_hold": 2 * GIB}, min_holds=min_holds)
        with pytest.raises(BadRequest, match="phase"):
            a.reserve({}, phase="Serving!")
