"""A device's broker session (adapters/device_session.py, opened by adapters/sessions.py):
reporters merge into one reservation map, an unreachable broker is a warning (or under
KVCACHED_REQUIRE=1 an error), and a session whose round trip failed answers None from then on
without asking its broker again."""

from __future__ import annotations

import pytest

from kvcached_broker.adapters import process_state, sessions, worker_identity
from kvcached_broker.client import BudgetExceeded

from helpers import GIB, MIB


def test_reporters_merge_into_one_reservation_map(adapter_broker):
    ident = worker_identity.WorkerIdentity("sglang", 0, instance="merge")
    sessions.session(ident).report("dsv4", {"swa_kv_pool": GIB, "c4_kv_pool": 512 * MIB})
    sessions.session(ident).report("kv_static", {"kv_static": 2 * GIB})
    sessions.session(ident).report("dsv4", {"swa_kv_pool": 2 * GIB, "c4_kv_pool": 0})  # rebuilt: replaces its own entry
    (inst,) = adapter_broker.status()["instances"]
    assert inst["pools"] == {"swa_kv_pool": 2 * GIB, "kv_static": 2 * GIB}
    with pytest.raises(BudgetExceeded):
        sessions.session(ident).report("kv_static", {"kv_static": 9 * GIB})
    sessions.session(ident).forget("dsv4")
    assert adapter_broker.status()["instances"][0]["pools"] == {"kv_static": 2 * GIB}


def test_unreachable_broker_is_a_warning_or_under_require_an_error(monkeypatch, short_tmp):
    process_state.reset()
    monkeypatch.setenv("KVCACHED_BROKER", f"ipc://{short_tmp}/none{{device}}.sock")
    monkeypatch.setenv("KVCACHED_BROKER_TIMEOUT_S", "0.3")
    ident = worker_identity.WorkerIdentity("sglang", 0, instance="lonely")
    assert sessions.session(ident) is None
    process_state.reset()
    monkeypatch.setenv("KVCACHED_REQUIRE", "1")
    with pytest.raises(sessions.BrokerRequired, match="KVCACHED_REQUIRE=1"):
        sessions.session(ident)
    process_state.reset()


def test_a_failed_round_trip_turns_the_device_unprotected_and_no_operation_asks_again(adapter_broker, monkeypatch):
    """One failure (here a timeout of a report) marks the device unprotected in the registry;
    every operation of that session then answers None, 0 or False with no request sent, and
    the registry opens no new session for the device."""
    from kvcached_broker.client import BrokerError

    ident = worker_identity.WorkerIdentity("sglang", 0, instance="failing")
    session = sessions.session(ident)
    assert session is not None and session.report("pool", {"kv_static": GIB}) is not None
    sent = []

    def timed_out(*args, **kwargs):
        sent.append(args)
        raise BrokerError("timeout", "no answer in 1 s")

    monkeypatch.setattr(session.client, "reserve", timed_out)
    monkeypatch.setattr(session.client, "acquire", timed_out)
    assert session.report("pool", {"kv_static": 2 * GIB}) is None
    assert len(sent) == 1 and "report pool" in (sessions.unprotected_reason(ident) or "")
    assert session.book.booked_bytes("pool") == GIB  # the book kept what the broker last answered
    assert not session.usable and sessions.session(ident) is None and sessions.existing(ident) is session
    assert session.hold("kv_sizing_hold", GIB) is None and session.pin_base() is None
    assert session.repin_base() is None and session.settle_warm_up() is None
    assert session.release_mapped("pool", 1, 0) is False
    assert session.guard("kvcached acquire", lambda: session.client.acquire(1)) is None
    assert len(sent) == 1  # nothing asked the broker again
    (inst,) = adapter_broker.status()["instances"]
    assert inst["pools"] == {"kv_static": GIB}


def test_a_usage_view_above_the_sessions_charge_is_dropped_not_a_reason_to_turn_unprotected(adapter_broker):
    """Views are never charged: one larger than what the session holds (its charge not caught up
    yet, as after a short broker restart) is left out of that report, the pools are reported,
    and the worker keeps its broker; the views go with a later report once they fit."""
    ident = worker_identity.WorkerIdentity("sglang", 0, instance="views")
    assert sessions.session(ident).report("pool", {"kv_static": GIB}, usage={"kv_static.layer0": 4 * GIB}) is not None
    assert sessions.unprotected_reason(ident) is None and sessions.session(ident) is not None
    (inst,) = adapter_broker.status()["instances"]
    assert inst["pools"] == {"kv_static": GIB}
    (session,) = inst["sessions"]
    assert session["usage_breakdown"] == {}
    sessions.session(ident).report("pool", {"kv_static": 8 * GIB}, usage={"kv_static.layer0": 4 * GIB})
    (session,) = adapter_broker.status()["instances"][0]["sessions"]
    assert session["usage_breakdown"] == {"kv_static.layer0": 4 * GIB}


@pytest.mark.parametrize(("device", "index"), [(3, 3), ("cuda:2", 2), ("cuda", 0), ("cpu", 0)])
def test_a_vllm_device_given_as_text_or_an_ordinal_names_its_cuda_ordinal(device, index):
    """kvcached's Model Runner V2 allocation passes the device as text (``"cuda:0"``): its text's
    ``index`` is ``str.index``, not an ordinal."""
    from kvcached_broker.adapters.vllm import parallel

    assert parallel.device_index(device) == index
