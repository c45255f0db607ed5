"""The worker's broker session (adapters/worker.py): reporters merge into one reservation map,
and an unreachable broker is a warning, or under KVCACHED_REQUIRE=1 an error."""

from __future__ import annotations

import pytest

from kvcached_broker.adapters import sessions, worker, worker_identity
from kvcached_broker.client import BudgetExceeded

from helpers import GIB, MIB


def test_reporters_merge_into_one_reservation_map(adapter_broker):
    ident = worker_identity.WorkerIdentity("sglang", 0, instance="merge")
    worker.report(ident, "dsv4", {"swa_kv_pool": GIB, "c4_kv_pool": 512 * MIB})
    worker.report(ident, "kv_static", {"kv_static": 2 * GIB})
    worker.report(ident, "dsv4", {"swa_kv_pool": 2 * GIB, "c4_kv_pool": 0})  # rebuilt: replaces its own entry
    (inst,) = adapter_broker.status()["instances"]
    assert inst["pools"] == {"swa_kv_pool": 2 * GIB, "kv_static": 2 * GIB}
    with pytest.raises(BudgetExceeded):
        worker.report(ident, "kv_static", {"kv_static": 9 * GIB})
    worker.forget(ident, "dsv4")
    assert adapter_broker.status()["instances"][0]["pools"] == {"kv_static": 2 * GIB}


def test_unreachable_broker_is_a_warning_or_under_require_an_error(monkeypatch, short_tmp):
    worker.reset()
    monkeypatch.setenv("KVCACHED_BROKER", f"ipc://{short_tmp}/none{{device}}.sock")
    monkeypatch.setenv("KVCACHED_BROKER_TIMEOUT_S", "0.3")
    ident = worker_identity.WorkerIdentity("sglang", 0, instance="lonely")
    assert sessions.session(ident) is None
    worker.reset()
    monkeypatch.setenv("KVCACHED_REQUIRE", "1")
    with pytest.raises(sessions.BrokerRequired, match="KVCACHED_REQUIRE=1"):
        sessions.session(ident)
    worker.reset()



def test_a_usage_view_above_the_sessions_charge_is_dropped_not_a_reason_to_turn_unprotected(adapter_broker):
    """Views are never charged: one larger than what the session holds (its charge not caught up
    yet, as after a short broker restart) is left out of that report, the pools are reported,
    and the worker keeps its broker; the views go with a later report once they fit."""
    ident = worker_identity.WorkerIdentity("sglang", 0, instance="views")
    assert worker.report(ident, "pool", {"kv_static": GIB}, usage={"kv_static.layer0": 4 * GIB}) is not None
    assert sessions.unprotected_reason(ident) is None and sessions.session(ident) is not None
    (inst,) = adapter_broker.status()["instances"]
    assert inst["pools"] == {"kv_static": GIB}
    (session,) = inst["sessions"]
    assert session["usage_breakdown"] == {}
    worker.report(ident, "pool", {"kv_static": 8 * GIB}, usage={"kv_static.layer0": 4 * GIB})
    (session,) = adapter_broker.status()["instances"][0]["sessions"]
    assert session["usage_breakdown"] == {"kv_static.layer0": 4 * GIB}


@pytest.mark.parametrize(("device", "index"), [(3, 3), ("cuda:2", 2), ("cuda", 0), ("cpu", 0)])
def test_a_vllm_device_given_as_text_or_an_ordinal_names_its_cuda_ordinal(device, index):
    """kvcached's Model Runner V2 allocation passes the device as text (``"cuda:0"``): its text's
    ``index`` is ``str.index``, not an ordinal."""
    from kvcached_broker.adapters.vllm import parallel

    assert parallel.device_index(device) == index
