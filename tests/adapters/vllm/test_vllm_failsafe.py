"""Every broker failure leaves a vLLM worker running unprotected with one warning, or stops it under REQUIRE.

Each failure kind (``tests/broker_failures.py``) is met on the worker's real start-up path:
vLLM's ``Worker.determine_available_memory`` wrapper (around a stand-in for the GPU profile)
and the KV cache allocation vLLM's own model runner makes.  While serving, elastic pages
that lose their broker grant themselves instead of failing the step.
"""

from __future__ import annotations

import pytest

import broker_failures
import vllm_shapes as shapes
from helpers import MIB
from test_vllm_sizing import determine, vllm_worker

from kvcached_broker.adapters import backing, worker
from kvcached_broker.adapters.tensors import storage_bytes
from kvcached_broker.adapters.vllm import parallel, worker_pages
from kvcached_broker.client import SessionEvicted


def _start_vllm() -> tuple[int, int]:
    """A worker's start: size the KV cache, then allocate it through vLLM's runner."""
    available = determine(200 * MIB)(vllm_worker())
    vc, kv_cfg = shapes.hybrid_config(16 * MIB)
    return available, storage_bytes(shapes.allocate(vc, kv_cfg))


@pytest.mark.parametrize("kind", broker_failures.KINDS)
def test_a_broker_failure_leaves_the_worker_unprotected_with_one_warning(kind, request, monkeypatch, adapter_state,
                                                                         patched_vllm, capsys):
    failing = broker_failures.arrange(kind, request, monkeypatch)
    failing.break_after_open(parallel.identity(0))
    if kind == "evicted":
        with pytest.raises(SessionEvicted):  # its memory was given away: fatal in every mode
            _start_vllm()
        return
    available, allocated = _start_vllm()
    assert available == 200 * MIB and allocated > 0  # no exception, and vLLM's own figure
    lines = broker_failures.unprotected_lines(capsys.readouterr().err)
    assert len(lines) == 1 and failing.reason in lines[0], lines


@pytest.mark.parametrize("kind", broker_failures.KINDS)
def test_under_require_a_broker_failure_stops_the_start_with_the_reason(kind, request, monkeypatch, adapter_state,
                                                                        patched_vllm):
    failing = broker_failures.arrange(kind, request, monkeypatch)
    failing.break_after_open(parallel.identity(0))
    monkeypatch.setenv("KVCACHED_REQUIRE", "1")
    expected = SessionEvicted if kind == "evicted" else worker.BrokerRequired
    with pytest.raises(expected) as caught:
        _start_vllm()
    if failing.reason:
        assert failing.reason in str(caught.value) and "KVCACHED_REQUIRE=1" in str(caught.value)


@pytest.mark.parametrize("kind", ["internal", "rate_limited", "unknown_code"])
def test_elastic_pages_that_lose_their_broker_while_serving_grant_themselves(kind, request, monkeypatch,
                                                                             adapter_state, patched_vllm, capsys):
    failing = broker_failures.arrange(kind, request, monkeypatch)
    backing.register_on_demand_backing(backing.RecordingBacking())
    vc, kv_cfg = shapes.hybrid_config(32 * MIB)
    shapes.allocate(vc, kv_cfg)
    pages = worker_pages.current()
    assert pages is not None and pages.budget.protected
    failing.break_after_open(parallel.identity(0))
    target = pages.num_blocks
    grown = pages.resize(target)  # EngineCore's collective_rpc: a miss this time, never an exception
    assert grown < target and not pages.budget.protected
    assert pages.resize(target) == target  # from then on the worker backs its own blocks
    (line,) = broker_failures.unprotected_lines(capsys.readouterr().err)
    assert failing.reason in line
