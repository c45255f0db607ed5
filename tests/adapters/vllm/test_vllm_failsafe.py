"""Every broker failure leaves a vLLM worker running unprotected with one warning, or stops it under REQUIRE.

Each failure kind (``tests/broker_failures.py``) is met on the worker's real start-up path:
vLLM's ``Worker.determine_available_memory`` wrapper (around a stand-in for the GPU profile)
and the KV cache allocation vLLM's own model runner makes.  (Elastic KV is kvcached mode, whose
failures while serving are covered in tests/adapters/kvcached and tests/adapters/vllm's kvcached-mode modules.)
"""

from __future__ import annotations

import pytest

import broker_failures
import vllm_shapes as shapes
from helpers import MIB
from test_vllm_sizing import determine, vllm_worker

from kvcached_broker.adapters import sessions
from kvcached_broker.adapters.tensors import storage_bytes
from kvcached_broker.adapters.vllm import parallel
from kvcached_broker.client import SessionEvicted

pytestmark = pytest.mark.runtime("vllm")


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
    expected = SessionEvicted if kind == "evicted" else sessions.BrokerRequired
    with pytest.raises(expected) as caught:
        _start_vllm()
    if failing.reason:
        assert failing.reason in str(caught.value) and "KVCACHED_REQUIRE=1" in str(caught.value)
