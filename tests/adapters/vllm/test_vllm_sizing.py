"""``Worker.determine_available_memory`` is capped (and held) at what the GPU's broker can grant.

The worker is vLLM's own ``Worker`` class; only vLLM's profile (which needs a GPU) is
replaced by a fixed figure, through the same wrapper the patch installs.
"""

from __future__ import annotations

import os

import pytest

from kvcached_broker.adapters import sessions
from kvcached_broker.adapters.tensors import storage_bytes
from kvcached_broker.adapters.vllm import kv_config, kv_sizing, kvcached_mode, parallel
from kvcached_broker.adapters.vllm.kv_budget import KVCacheBudgetError
from kvcached_broker.client import BrokerClient, BudgetExceeded

import vllm_shapes as shapes
from helpers import GIB, MIB

pytestmark = pytest.mark.runtime("vllm")

WEIGHTS = 256 * MIB
vllm_worker = shapes.gpu_worker
determine = shapes.determine


def mine(broker) -> dict:
    """This worker's session in status (the neighbour's session lives in this process too)."""
    session_id = sessions.session(parallel.identity(0)).client.session_id
    (found,) = [s for i in broker.status()["instances"] for s in i["sessions"] if s["id"] == session_id]
    return found


def held(broker):
    return mine(broker)["holds"].get("kv_sizing_hold", 0)


@pytest.fixture
def neighbour(gpu_broker):
    client = BrokerClient.connect("sglang-neighbour", endpoint=gpu_broker.endpoint, credit_pages=0)
    yield client
    client.close()


def test_the_real_worker_method_is_wrapped(patched_vllm):
    from vllm.v1.worker.gpu_worker import Worker

    assert getattr(Worker.determine_available_memory, "__kvcached_broker_wrapped__", False)


def test_a_profile_above_the_broker_room_is_lowered_and_held(patched_vllm, gpu_broker, neighbour):
    neighbour.reserve({"weights": 700 * MIB})
    assert determine(600 * MIB)(vllm_worker()) == 324 * MIB
    assert held(gpu_broker) == 324 * MIB
    with pytest.raises(BudgetExceeded):  # held: the neighbour cannot take it before vLLM allocates
        neighbour.reserve({"weights": 701 * MIB})


def test_a_profile_that_fits_is_held_unchanged(patched_vllm, gpu_broker):
    assert determine(200 * MIB)(vllm_worker()) == 200 * MIB
    assert held(gpu_broker) == 200 * MIB


def test_explicit_kv_cache_memory_bytes_is_honoured_exactly(patched_vllm, gpu_broker, neighbour):
    neighbour.reserve({"weights": 700 * MIB})
    assert determine(256 * MIB)(vllm_worker(kv_cache_memory_bytes=256 * MIB)) == 256 * MIB
    assert held(gpu_broker) == 256 * MIB


def test_explicit_kv_cache_memory_bytes_beyond_the_room_fails_at_startup(patched_vllm, gpu_broker, neighbour):
    neighbour.reserve({"weights": 700 * MIB})
    with pytest.raises(KVCacheBudgetError) as caught:
        determine(512 * MIB)(vllm_worker(kv_cache_memory_bytes=512 * MIB))
    message = str(caught.value)
    assert "kv_cache_memory_bytes" in message and gpu_broker.endpoint in message
    assert "asked 512.00 MiB, 324.00 MiB free" in message and "budget 1.00 GiB" in message
    assert "held by sglang-neighbour 700.00 MiB" in message
    assert held(gpu_broker) == 0


def test_less_room_than_one_max_length_request_fails_at_startup(patched_vllm, gpu_broker, neighbour):
    neighbour.reserve({"weights": GIB - 4 * MIB})
    w = vllm_worker(max_model_len=32768)  # two full-attention layers: 32 MiB for one request
    assert kv_sizing.min_kv_bytes(w) > 4 * MIB
    with pytest.raises(KVCacheBudgetError, match="max_model_len request") as caught:
        determine(GIB)(w)
    assert "4.00 MiB free" in str(caught.value)


def test_in_kvcached_mode_the_virtual_size_is_capped_at_the_budget_and_nothing_is_held(
    patched_vllm, gpu_broker, neighbour, monkeypatch
):
    neighbour.reserve({"weights": 700 * MIB})
    monkeypatch.setattr(kvcached_mode, "active", lambda: True)  # kvcached's integration initialised here
    assert determine(4 * GIB)(vllm_worker()) == GIB  # the most it could ever get, not what is free now
    assert held(gpu_broker) == 0  # kvcached maps nothing at sizing time: its grants come as it maps


# ------------------------------------------------------------ a device that measures the worker
@pytest.fixture
def weights_loaded(gpu_broker, measured):
    """The device measures this process using its weights (nothing reported yet), as NVML would."""
    measured.set(os.getpid(), WEIGHTS)
    return measured


def _count_reserves(monkeypatch, broker) -> list[int]:
    """Free bytes after each reserve request this worker's session sends (one entry per request)."""
    client = sessions.session(parallel.identity(0)).client
    original, after = client.reserve, []

    def reserve(*args, **kwargs):
        result = original(*args, **kwargs)
        after.append(broker.status()["free_bytes"])
        return result

    monkeypatch.setattr(client, "reserve", reserve)
    return after


def test_the_sizing_hold_is_charged_on_top_of_the_weights(patched_vllm, gpu_broker, weights_loaded, neighbour):
    assert determine(4 * GIB)(vllm_worker()) == GIB - WEIGHTS  # the weights are charged, not free
    me = mine(gpu_broker)
    assert me["holds"] == {"kv_sizing_hold": GIB - WEIGHTS} and me["measured_bytes"] == WEIGHTS
    assert me["pools"] == {"runtime_base": WEIGHTS, "kv_sizing_hold": GIB - WEIGHTS}  # pinned with the hold
    with pytest.raises(BudgetExceeded):
        neighbour.reserve({"weights": MIB})


def test_the_hold_becomes_kv_static_in_one_request_with_no_dip_while_the_device_lags(
    patched_vllm, gpu_broker, weights_loaded, monkeypatch
):
    kv_bytes = determine(64 * MIB)(vllm_worker())
    vc, kv_cfg = shapes.hybrid_config(kv_bytes)
    free_after = _count_reserves(monkeypatch, gpu_broker)
    caches = shapes.allocate(vc, kv_cfg)  # the device still measures only the weights
    buffer = storage_bytes(caches)
    assert buffer <= kv_bytes
    assert free_after[0] == GIB - WEIGHTS - kv_config.buffer_bytes(kv_cfg)  # hold -> kv_static, one request
    assert free_after[-1] == GIB - WEIGHTS - buffer and len(free_after) == 2  # then what was allocated
    me = mine(gpu_broker)
    assert me["holds"] == {} and me["pools"] == {"runtime_base": WEIGHTS, "kv_static": buffer}
    weights_loaded.set(os.getpid(), WEIGHTS + buffer)  # the device catches up
    assert gpu_broker.status()["free_bytes"] == GIB - WEIGHTS - buffer


def test_a_buffer_reported_before_its_allocation_is_not_covered_by_the_weights(patched_vllm, gpu_broker, weights_loaded):
    vc, kv_cfg = shapes.hybrid_config(64 * MIB)  # no sizing first (a worker that never profiled)
    buffer = storage_bytes(shapes.allocate(vc, kv_cfg))
    assert mine(gpu_broker)["pools"] == {"runtime_base": WEIGHTS, "kv_static": buffer}  # base pinned first
    assert gpu_broker.status()["free_bytes"] == GIB - WEIGHTS - buffer
