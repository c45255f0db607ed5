"""``Worker.determine_available_memory`` is capped (and held) at what the GPU's broker can grant.

The worker is vLLM's own ``Worker`` class; only vLLM's profile (which needs a GPU) is
replaced by a fixed figure, through the same wrapper the patch installs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvcached_broker.adapters import backing, worker
from kvcached_broker.adapters.vllm import kv_sizing, parallel
from kvcached_broker.adapters.vllm.kv_budget import KVCacheBudgetError
from kvcached_broker.client import BrokerClient, BudgetExceeded

import vllm_shapes as shapes
from helpers import GIB, MIB


class WithMaxModelLen:
    """A VllmConfig with a model length (a CPU VllmConfig has no model config)."""

    def __init__(self, vc, max_model_len: int):
        self._vc = vc
        self.model_config = SimpleNamespace(max_model_len=max_model_len)

    def __getattr__(self, name):
        return getattr(self._vc, name)


def vllm_worker(kv_cache_memory_bytes=None, max_model_len=4096):
    from vllm.v1.worker.gpu_worker import Worker

    vc = shapes.vllm_config()
    vc.cache_config.kv_cache_memory_bytes = kv_cache_memory_bytes
    w = object.__new__(Worker)
    w.device = torch.device("cpu")
    w.cache_config = vc.cache_config
    w.vllm_config = WithMaxModelLen(vc, max_model_len)
    specs = shapes.hybrid_specs()
    w.model_runner = SimpleNamespace(get_kv_cache_spec=lambda: specs)
    return w


def determine(profiled_bytes):
    """The patch's wrapper around a stand-in for vLLM's GPU profile."""
    return kv_sizing.wrap_determine_available_memory(lambda self: profiled_bytes)


def held(broker):
    session_id = worker.session(parallel.identity(0)).session_id
    sessions = [s for i in broker.status()["instances"] for s in i["sessions"] if s["id"] == session_id]
    return sessions[0]["pools"].get("kv_static", 0)


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
    assert "asked 512.00 MiB" in message and "1.00 GiB budget" in message and "sglang-neighbour 700.00 MiB" in message
    assert held(gpu_broker) == 0


def test_less_room_than_one_max_length_request_fails_at_startup(patched_vllm, gpu_broker, neighbour):
    neighbour.reserve({"weights": GIB - 4 * MIB})
    w = vllm_worker(max_model_len=32768)  # two full-attention layers: 32 MiB for one request
    assert kv_sizing.min_kv_bytes(w) > 4 * MIB
    with pytest.raises(KVCacheBudgetError, match="max_model_len request") as caught:
        determine(GIB)(w)
    assert "grantable 4.00 MiB" in str(caught.value)


def test_elastic_workers_are_capped_at_the_budget_and_hold_nothing(patched_vllm, gpu_broker, neighbour):
    neighbour.reserve({"weights": 700 * MIB})
    backing.register_on_demand_backing(backing.RecordingBacking())
    assert determine(4 * GIB)(vllm_worker()) == GIB
    assert held(gpu_broker) == 0
