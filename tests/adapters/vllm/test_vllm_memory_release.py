"""vLLM's sleep mode, followed through to the broker: asleep, the KV cache is not charged.

The KV buffer is allocated by vLLM's own runner code (the adapter's patch on it); sleep and
wake are the adapter's wrappers of vLLM's ``Worker.sleep``/``wake_up`` and
``Executor.wake_up`` around stand-ins for vLLM's bodies, which need CUDA's allocator.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import vllm_shapes as shapes
from helpers import GIB, MIB

from kvcached_broker.adapters.vllm import kv_budget, kv_config, memory_release
from kvcached_broker.client import BrokerClient


@pytest.fixture(autouse=True)
def no_sleepers():
    memory_release.reset()
    yield
    memory_release.reset()


def charged(broker):
    return next((i["pools"] for i in broker.status()["instances"] if i["name"] == "vllm-test"), {})


class Body:
    """Stands in for the body of vLLM's method (CuMemAllocator needs CUDA); records calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, owner, *args):
        self.calls.append(args)


def test_the_real_sleep_and_wake_methods_are_wrapped(patched_vllm):
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.worker.gpu_worker import Worker

    for method in (Worker.sleep, Worker.wake_up, Executor.wake_up):
        assert getattr(method, "__kvcached_broker_wrapped__", False), method


def test_a_sleeping_worker_is_not_charged_and_a_refused_wake_maps_nothing(patched_vllm, gpu_broker):
    vc, kv_cfg = shapes.hybrid_config(64 * MIB)
    shapes.allocate(vc, kv_cfg)
    buffer = kv_config.buffer_bytes(kv_cfg)
    assert charged(gpu_broker) == {"kv_static": buffer}
    vllm_worker = SimpleNamespace(device=torch.device("cpu"))
    sleep, wake = Body(), Body()

    memory_release.wrap_sleep(sleep)(vllm_worker, 1)
    assert sleep.calls == [(1,)] and charged(gpu_broker) == {}  # its memory went back to the device

    neighbour = BrokerClient.connect("neighbour", endpoint=gpu_broker.endpoint, credit_pages=0)
    try:
        neighbour.reserve({"weights": GIB - buffer // 2})
        with pytest.raises(kv_budget.KVCacheBudgetError) as caught:
            memory_release.wrap_wake_up(wake)(vllm_worker, ["kv_cache"])
        assert wake.calls == [] and charged(gpu_broker) == {}  # nothing mapped, nothing overbooked
        assert gpu_broker.endpoint in str(caught.value) and "neighbour" in str(caught.value)
        memory_release.wrap_wake_up(wake)(vllm_worker, ["weights"])  # weights only: the KV stays asleep
        assert wake.calls == [(["weights"],)] and charged(gpu_broker) == {}
        neighbour.reserve({})
        memory_release.wrap_wake_up(wake)(vllm_worker, None)
    finally:
        neighbour.close()
    assert wake.calls[-1] == (None,) and charged(gpu_broker) == {"kv_static": buffer}


class Executor:
    """EngineCore's executor: ``collective_rpc`` runs the callable, pickled, in each worker."""

    def __init__(self):
        self.is_sleeping = True

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        import cloudpickle  # vLLM's own dependency (its executors pickle callables with it)

        return [cloudpickle.loads(cloudpickle.dumps(method))(SimpleNamespace(), *args, **(kwargs or {}))]


def test_engine_core_admits_every_worker_before_any_wakes(patched_vllm, gpu_broker):
    vc, kv_cfg = shapes.hybrid_config(64 * MIB)
    shapes.allocate(vc, kv_cfg)
    buffer = kv_config.buffer_bytes(kv_cfg)
    memory_release.wrap_sleep(Body())(SimpleNamespace(device=torch.device("cpu")), 2)
    executor, body = Executor(), Body()
    neighbour = BrokerClient.connect("neighbour", endpoint=gpu_broker.endpoint, credit_pages=0)
    try:
        neighbour.reserve({"weights": GIB - buffer // 2})
        with pytest.raises(kv_budget.KVCacheBudgetError, match="wake up"):
            memory_release.wrap_executor_wake_up(body)(executor, None)
        assert body.calls == [] and charged(gpu_broker) == {}  # no worker was told to wake
        neighbour.reserve({})
        memory_release.wrap_executor_wake_up(body)(executor, None)
    finally:
        neighbour.close()
    assert body.calls == [(None,)] and charged(gpu_broker) == {"kv_static": buffer}
