"""vLLM's sleep mode, followed through to the broker: what a sleeping worker handed back is not charged.

The KV buffer is allocated by vLLM's own runner code (the adapter's patch on it); sleep,
discard and wake are the adapter's wrappers of vLLM's ``Worker.sleep``/``discard``/``wake_up``
and ``Executor.wake_up`` around stand-ins for vLLM's bodies, which need CUDA's allocator.  On
the simulated GPU that measures this process as NVML would (``device_usage``), the stand-ins
tell the device what they freed and mapped.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

import vllm_shapes as shapes
from helpers import GIB, MIB

from kvcached_broker.adapters.vllm import kv_budget, kv_config, memory_release
from kvcached_broker.client import BrokerClient

pytestmark = pytest.mark.runtime("vllm")


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


# ------------------------------------------- on a device that measures the worker, as NVML does
CONTEXT, WEIGHTS = 32 * MIB, 256 * MIB  # what the worker uses besides its KV cache


class Device:
    """What the simulated GPU measures this worker using, tag by tag; vLLM's sleep, discard and
    wake (CuMemAllocator needs CUDA) free and map the tagged memory here."""

    def __init__(self, measured, sizes: dict[str, int]):
        self.measured, self.sizes, self.mapped = measured, sizes, set(sizes)
        self.calls: list[tuple] = []
        self._show()

    def _show(self) -> None:
        self.measured.set(os.getpid(), CONTEXT + sum(self.sizes[t] for t in self.mapped))

    def sleep(self, owner, level=1):
        self.calls.append(("sleep", level))
        self.mapped.clear()
        self._show()

    def discard(self, owner, tags):
        self.calls.append(("discard", tuple(tags)))
        self.mapped -= set(tags)
        self._show()

    def wake_up(self, owner, tags=None):
        self.calls.append(("wake_up", tags))
        self.mapped |= set(tags or self.sizes)
        self._show()


def _allocated_worker(measured):
    """A worker whose weights are loaded and whose KV buffer vLLM's runner allocated."""
    measured.set(os.getpid(), CONTEXT + WEIGHTS)
    vc, kv_cfg = shapes.hybrid_config(64 * MIB)
    shapes.allocate(vc, kv_cfg)  # the runtime base is pinned before the buffer is reported
    buffer = kv_config.buffer_bytes(kv_cfg)
    return Device(measured, {"weights": WEIGHTS, "kv_cache": buffer}), buffer


def _free(broker) -> int:
    return broker.status()["free_bytes"]


@pytest.mark.parametrize("level", [1, 2])
def test_a_sleeping_worker_is_charged_for_neither_its_weights_nor_its_kv_cache(patched_vllm, gpu_broker, measured,
                                                                              level):
    device, buffer = _allocated_worker(measured)
    assert charged(gpu_broker) == {"runtime_base": CONTEXT + WEIGHTS, "kv_static": buffer}
    me = SimpleNamespace(device=torch.device("cpu"))

    memory_release.wrap_sleep(device.sleep)(me, level)  # level 1 offloads the weights, level 2 discards them
    assert charged(gpu_broker) == {"runtime_base": CONTEXT} and _free(gpu_broker) == GIB - CONTEXT

    neighbour = BrokerClient.connect("neighbour", endpoint=gpu_broker.endpoint, credit_pages=0)
    try:
        neighbour.reserve({"weights": GIB - CONTEXT - WEIGHTS // 2})
        with pytest.raises(kv_budget.KVCacheBudgetError) as caught:
            memory_release.wrap_wake_up(device.wake_up)(me, ["weights"])
        assert gpu_broker.endpoint in str(caught.value) and "neighbour" in str(caught.value)
        assert device.calls == [("sleep", level)]  # vLLM never mapped memory the broker refused
        assert charged(gpu_broker) == {"runtime_base": CONTEXT}
        neighbour.reserve({})
    finally:
        neighbour.close()
    memory_release.wrap_wake_up(device.wake_up)(me, ["weights"])  # the KV cache stays asleep
    assert charged(gpu_broker) == {"runtime_base": CONTEXT + WEIGHTS} and _free(gpu_broker) == GIB - CONTEXT - WEIGHTS
    memory_release.wrap_wake_up(device.wake_up)(me, ["kv_cache"])
    assert charged(gpu_broker) == {"runtime_base": CONTEXT + WEIGHTS, "kv_static": buffer}
    assert _free(gpu_broker) == GIB - CONTEXT - WEIGHTS - buffer


def test_discarded_weights_are_no_longer_charged(patched_vllm, gpu_broker, measured):
    from vllm.v1.worker.gpu_worker import Worker

    if "discard" not in vars(Worker):
        pytest.skip("this vLLM has no Worker.discard (0.33+)")
    assert getattr(Worker.discard, "__kvcached_broker_wrapped__", False)
    device, buffer = _allocated_worker(measured)
    me = SimpleNamespace(device=torch.device("cpu"))
    memory_release.wrap_discard(device.discard)(me, ("weights",))
    assert charged(gpu_broker) == {"runtime_base": CONTEXT, "kv_static": buffer}
    memory_release.wrap_wake_up(device.wake_up)(me, ["weights"])
    assert charged(gpu_broker) == {"runtime_base": CONTEXT + WEIGHTS, "kv_static": buffer}


def test_engine_core_admits_the_weights_of_every_worker_before_any_wakes(patched_vllm, gpu_broker, measured):
    device, buffer = _allocated_worker(measured)
    memory_release.wrap_sleep(device.sleep)(SimpleNamespace(device=torch.device("cpu")), 1)
    executor, body = Executor(), Body()
    neighbour = BrokerClient.connect("neighbour", endpoint=gpu_broker.endpoint, credit_pages=0)
    try:
        neighbour.reserve({"weights": GIB - CONTEXT - WEIGHTS - buffer // 2})  # room for the weights alone
        with pytest.raises(kv_budget.KVCacheBudgetError, match="wake up"):
            memory_release.wrap_executor_wake_up(body)(executor, None)
        assert body.calls == [] and charged(gpu_broker) == {"runtime_base": CONTEXT}  # admitted, then handed back
        memory_release.wrap_executor_wake_up(body)(executor, ["weights"])
        assert body.calls == [(["weights"],)]
    finally:
        neighbour.close()
    assert charged(gpu_broker) == {"runtime_base": CONTEXT + WEIGHTS}  # admitted ahead of the mapping


class CountingExecutor(Executor):
    def __init__(self):
        super().__init__()
        self.actions: list[str] = []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.actions.append(args[0])
        return super().collective_rpc(method, timeout, args, kwargs)


def test_a_worker_whose_broker_fails_on_wake_answers_engine_core_which_hands_every_worker_back(
    patched_vllm, gpu_broker, measured
):
    """An eviction (or ``BrokerRequired``) in one worker's admission must not escape its
    ``collective_rpc``: EngineCore hears why, and asks every worker to hand back what it was admitted."""
    device, _ = _allocated_worker(measured)
    memory_release.wrap_sleep(device.sleep)(SimpleNamespace(device=torch.device("cpu")), 1)
    with gpu_broker.admin() as admin:
        (session,) = [s for i in gpu_broker.status()["instances"] for s in i["sessions"]]
        admin.evict(session["id"])
    executor, body = CountingExecutor(), Body()
    with pytest.raises(kv_budget.KVCacheBudgetError, match="SessionEvicted"):
        memory_release.wrap_executor_wake_up(body)(executor, None)
    assert executor.actions == ["admit", "roll_back"] and body.calls == []
