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
    from kvcached_broker.client import BrokerUnavailable

    ident = worker_identity.WorkerIdentity("sglang", 0, instance="failing")
    session = sessions.session(ident)
    assert session is not None and session.report("pool", {"kv_static": GIB}) is not None
    sent = []

    def timed_out(*args, **kwargs):
        sent.append(args)
        raise BrokerUnavailable("kvcached-broker at ipc:///x did not answer within 1s")

    monkeypatch.setattr(session.client, "reserve", timed_out)
    monkeypatch.setattr(session.client, "acquire", timed_out)
    assert session.report("pool", {"kv_static": 2 * GIB}) is None
    assert len(sent) == 1 and "report pool: [unavailable] " in (sessions.unprotected_reason(ident) or "")
    assert session.book.booked_bytes("pool") == GIB  # the book kept what the broker last answered
    assert not session.usable and sessions.session(ident) is None and sessions.existing(ident) is session
    assert session.hold("kv_sizing_hold", GIB) is None and session.pin_base() is None
    assert session.repin_base() is None and session.settle_warm_up() is None
    assert session.release_mapped("pool", 1, 0) is False
    assert session.guard("kvcached acquire", lambda: session.client.acquire(1)) is None
    assert len(sent) == 1  # nothing asked the broker again
    (inst,) = adapter_broker.status()["instances"]
    assert inst["pools"] == {"kv_static": GIB}


def test_the_guard_takes_a_malformed_answer_as_a_broker_failure_and_lets_a_bug_through(adapter_broker):
    """A ``ProtocolError`` (the client read an answer of another shape) turns the device
    unprotected like any broker failure; any other exception inside a guarded call is a bug of
    the caller's and reaches it, with the session still usable."""
    from kvcached_broker.client.protocol import ProtocolError

    ident = worker_identity.WorkerIdentity("sglang", 0, instance="guarded")
    session = sessions.session(ident)
    assert session is not None

    def buggy():
        return {}["missing"]

    with pytest.raises(KeyError):
        session.guard("buggy read", buggy)
    assert session.usable and sessions.unprotected_reason(ident) is None

    def malformed():
        raise ProtocolError("the broker's answer is not a ReserveResult: Object missing required field `holds`")

    assert session.guard("report pool", malformed) is None
    assert not session.usable and "is not a ReserveResult" in (sessions.unprotected_reason(ident) or "")


def test_a_reopen_whose_endpoint_check_cannot_look_up_the_broker_user_turns_the_device_unprotected(
        broker_factory, monkeypatch):
    """After a broker restart that lost the session, the next report opens it again, and the
    client checks the broker's socket again: a ``KVCACHED_BROKER_UID`` name that cannot be looked
    up at that moment (an NSS outage) is a broker failure, never an exception into the runtime."""
    import os
    import pwd
    import shutil

    from kvcached_broker.client import BrokerClient

    monkeypatch.setenv("KVCACHED_BROKER_UID", pwd.getpwuid(os.getuid()).pw_name)
    b = broker_factory(simulate="8GiB")
    process_state.reset()
    sessions.set_client_factory(lambda ident: BrokerClient.connect(
        ident.instance_name(), endpoint=b.endpoint, page_bytes=ident.page_bytes, credit_pages=0))
    try:
        ident = worker_identity.WorkerIdentity("sglang", 0, instance="nss")
        session = sessions.session(ident)
        assert session is not None and session.report("pool", {"kv_static": GIB}) is not None
        b.kill()
        shutil.rmtree(b.state_dir, ignore_errors=True)  # the broker lost the session: the next request opens it again
        b.start()

        def nss_down(name):
            raise KeyError(f"getpwnam(): name not found: {name!r}")

        monkeypatch.setattr(pwd, "getpwnam", nss_down)
        assert session.report("pool", {"kv_static": 2 * GIB}) is None
        assert "KVCACHED_BROKER_UID" in (sessions.unprotected_reason(ident) or "")
    finally:
        monkeypatch.undo()
        process_state.reset()
        sessions.set_client_factory(None)


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


def test_a_session_kept_past_a_reset_asks_nothing_and_touches_nothing_opened_after_it(adapter_broker):
    """A holder that outlives a reset of the process's state (a kvcached pool's grants, closed by
    its governor or a broadcast worker after the reset) keeps the session it opened: that session
    was closed with the registry, so its operations answer None, False or nothing without a
    round trip.  They neither open a session in the registry built after the reset nor mark its
    device unprotected, and the session opened there keeps its pools (before the session object,
    each call looked its session up again by identity: it opened a new one, released pages it
    never held there, and turned the new registry's device unprotected)."""
    from kvcached_broker.adapters.kvcached.geometry import PoolGeometry
    from kvcached_broker.adapters.kvcached.grants import SessionGrants

    from helpers import connect_to

    ident = worker_identity.WorkerIdentity("sglang", 0, instance="outlived")
    geometry = PoolGeometry(num_layers=1, page_size=ident.page_bytes, num_kv_buffers=1, virtual_pages=64)
    grants, why = SessionGrants.open(ident, geometry)
    assert grants is not None, why
    assert grants.acquire(4, 1) == 4 and grants.report("pool", {"kv_static": GIB})
    old = grants.session
    process_state.reset()
    sessions.set_client_factory(connect_to(adapter_broker.endpoint))
    new = sessions.session(ident)
    assert new is not None and new is not old and new.report("pool", {"kv_static": 2 * GIB}) is not None

    assert not old.usable and grants.lost() == "the process's broker sessions were closed"
    assert grants.acquire(4, 1) is None and grants.release(2, mapped=0, key="pool") is False
    assert grants.release(2) is False and grants.report("pool", {"kv_static": 3 * GIB}) is False
    grants.mapped("pool", 1)
    grants.idle("pool", 1)
    grants.forget("pool")
    assert old.repin_base() is None and old.suspend(["pool"]) == 0 and old.settle_warm_up() is None

    assert sessions.existing(ident) is new and new.usable and sessions.unprotected_reason(ident) is None
    assert new.booked_bytes("pool") == 2 * GIB and new.client.mapped_pages == 0 and new.client.held_pages == 0
    (inst,) = adapter_broker.status()["instances"]
    (live,) = inst["sessions"]
    assert live["id"] == new.client.session_id and inst["pools"] == {"kv_static": 2 * GIB}
    assert live["granted_pages"] == 0
