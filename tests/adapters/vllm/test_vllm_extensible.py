"""vLLM's extensible KV cache (0.34+) under the broker: every commit admitted before it maps.

vLLM's own classes on CPU: the planner's config, ``pad_kv_cache_segments``, ``ExtensibleKVCache``
over a real ``ExtensibleTensor``, ``allocate_kv_cache(allocate=...)`` through Model Runner V2's
binding, ``committable_blocks`` and ``measure_kv_cache_blocks``.  Only the CUDA driver's VMM calls
are a double (:class:`VmmDouble`, host memory): every physical chunk it creates is memory the
simulated GPU then measures this worker using (as NVML would), and at each one it records what the
broker charged the worker's cache before the chunk was mapped.  The bodies of vLLM's
``compile_or_warm_up_model``, ``extend_kv_cache``, ``sleep`` and ``wake_up`` (CUDA graphs, the
forward passes, CuMemAllocator) are stand-ins that commit, shrink, release and recommit the real
cache as vLLM's do, through the adapter's wrappers of the real methods.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
from types import SimpleNamespace

import pytest
import torch

import vllm_shapes as shapes
from helpers import GIB, MIB

from kvcached_broker.adapters import sessions, support
from kvcached_broker.adapters.versions import installed
from kvcached_broker.adapters.vllm import extensible, kv_budget, kv_sizing, memory_release, parallel
from kvcached_broker.client import BrokerClient

pytestmark = [pytest.mark.runtime("vllm"), pytest.mark.skipif(
    not support.VLLM.at_least("extensible_kv_cache", installed("vllm") or support.VLLM.supported.minimum),
    reason="vLLM's extensible KV cache arrived in 0.34")]

GRANULE = 2 * MIB
WEIGHTS = 128 * MIB
DEVICE = torch.device("cuda", 0)  # what vLLM gives the cache; the double backs it with host memory


class VmmDouble:
    """``vllm.utils.vmm_driver``'s driver on host memory, each chunk measured on the simulated GPU."""

    dlpack_device_type = 1  # kDLCPU: the reservation's views are CPU tensors

    def __init__(self, measured, broker):
        self._measured, self._broker = measured, broker
        self._ids = itertools.count(1)
        self._chunks: dict[int, int] = {}
        self._keep: list[mmap.mmap] = []
        self.physical_bytes = 0
        #: (bytes mapped after the chunk, the cache's pool the broker charged when it was created)
        self.creates: list[tuple[int, int]] = []

    def granularity(self, device_index: int) -> int:
        return GRANULE

    def ensure_context(self, device_index: int) -> None:
        pass

    def reserve(self, size: int) -> int:
        area = mmap.mmap(-1, size)  # address space: pages are backed on first touch only
        self._keep.append(area)
        return ctypes.addressof(ctypes.c_char.from_buffer(area))

    def free_reserved(self, ptr: int, size: int) -> None:
        pass

    def create(self, size: int, device_index: int, export_handle_types: int = 0) -> int:
        charged = self._broker_pool()
        handle = next(self._ids)
        self._chunks[handle] = size
        self.physical_bytes += size
        self.creates.append((self.physical_bytes, charged))
        self._measured.set(os.getpid(), WEIGHTS + self.physical_bytes)
        return handle

    def map(self, ptr: int, size: int, handle: int) -> None:
        pass

    def set_access(self, ptr: int, size: int, device_index: int) -> None:
        pass

    def unmap(self, ptr: int, size: int) -> None:
        pass

    def release(self, handle: int) -> None:
        self.physical_bytes -= self._chunks.pop(handle)
        self._measured.set(os.getpid(), WEIGHTS + self.physical_bytes)

    def _broker_pool(self) -> int:
        session = me(self._broker)
        return session["pools"].get("kv_extensible", 0) if session else 0


def me(broker) -> dict | None:
    client = sessions.session(parallel.identity(0)).client
    return next((s for i in broker.status()["instances"] for s in i["sessions"] if s["id"] == client.session_id), None)


@pytest.fixture
def driver(patched_vllm, gpu_broker, measured, monkeypatch):
    from vllm.utils import extensible_tensor

    double = VmmDouble(measured, gpu_broker)
    monkeypatch.setattr(extensible_tensor, "get_vmm_driver", lambda: double)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *args: None)  # no device to wait for
    measured.set(os.getpid(), WEIGHTS)
    extensible.reset()
    yield double
    extensible.reset()
    memory_release.reset()


@pytest.fixture
def device_reads(monkeypatch):
    """What vLLM reads of the device (no CUDA here): far more free than the broker's budget, as a
    GPU looks while a neighbour's admitted memory is not allocated yet."""
    from vllm.v1.worker import extensible_kv_cache as ekv

    free_bytes, total_bytes = 4 * GIB, 8 * GIB
    monkeypatch.setattr(ekv, "device_memory_info", lambda *args: (free_bytes, total_bytes))
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda *args: None)
    monkeypatch.setattr(torch.accelerator, "memory_reserved", lambda *args: 0)
    monkeypatch.setattr(torch.accelerator, "get_memory_info", lambda *args: (free_bytes, total_bytes))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda *args: None)
    return SimpleNamespace(free_bytes=free_bytes, total_bytes=total_bytes)


def sized(profiled_bytes: int, slack_bytes: int = 0):
    """vLLM's Worker sized through the adapter (its profile stood in): the KV bytes it may plan."""
    w = shapes.gpu_worker()
    w.peak_activation_memory = slack_bytes
    return w, shapes.determine(profiled_bytes)(w)


def new_cache(kv_bytes: int):
    """The extensible cache vLLM 0.34's worker builds from the planned config, allocated through
    Model Runner V2's ``allocate_kv_cache`` binding with the cache's ``allocate=`` hook."""
    from vllm.v1.worker import extensible_kv_cache as ekv
    from vllm.v1.worker.gpu import attn_utils

    vc, planned = shapes.hybrid_config(kv_bytes)
    layout = shapes.layout_of(vc)
    config = ekv.pad_kv_cache_segments(planned, layout, GRANULE)
    cache = ekv.ExtensibleKVCache(config, DEVICE, layout)
    attn_utils.allocate_kv_cache(config, DEVICE, layout, allocate=cache.allocate)
    return vc, cache


def charged(broker) -> tuple[dict, dict]:
    """This worker's resident pools and its holds (status shows holds among the pools too)."""
    session = me(broker)
    holds = session["holds"]
    return {k: v for k, v in session["pools"].items() if k not in holds}, holds


def test_the_sizing_hold_turns_into_the_pool_as_the_cache_commits_each_admitted_before_it_maps(driver, gpu_broker):
    _, kv_bytes = sized(256 * MIB)
    assert charged(gpu_broker)[1] == {"kv_sizing_hold": kv_bytes}
    _, cache = new_cache(kv_bytes)
    first = cache.physical_bytes  # the null block, a granule per segment
    pools, holds = charged(gpu_broker)
    assert first > 0 and pools == {"runtime_base": WEIGHTS, "kv_extensible": first}
    assert holds == {"kv_sizing_hold": kv_bytes - first}  # the hold became the pool: a transfer

    cache.commit(cache.capacity_blocks // 2)  # what a warm-up step addresses
    grown = cache.physical_bytes
    pools, holds = charged(gpu_broker)
    assert grown > first and pools["kv_extensible"] == grown and holds == {"kv_sizing_hold": kv_bytes - grown}
    assert me(gpu_broker)["usage_breakdown"]  # the cache groups over the committed blocks, never charged
    assert driver.creates and all(charged_pool >= mapped for mapped, charged_pool in driver.creates)

    cache.commit(cache.min_committed_blocks, shrink=True)  # the warm-up gives its blocks up before capture
    pools, holds = charged(gpu_broker)
    assert pools["kv_extensible"] == cache.physical_bytes == first == driver.physical_bytes
    assert holds == {"kv_sizing_hold": kv_bytes - first}  # kept for the final size, not given away
    assert gpu_broker.status()["free_bytes"] == GIB - WEIGHTS - kv_bytes


def test_the_warm_up_and_the_final_size_get_no_more_blocks_than_the_broker_admitted(driver, gpu_broker, device_reads):
    """The capacity vLLM planned from the sized figure maps a little more than it (each segment is
    whole granules): the blocks the warm-up may address and those the scheduler gets are the ones
    whose memory the broker admitted, however empty the device looks."""
    from vllm.v1.worker import extensible_kv_cache as ekv

    _, kv_bytes = sized(250 * MIB)
    _, cache = new_cache(kv_bytes)
    admitted = cache.blocks_within(kv_bytes)
    assert cache.physical_bytes_for(cache.capacity_blocks) > kv_bytes  # the capacity's granules exceed the hold

    own_warm_up = type(cache).committable_blocks.__wrapped__(cache)  # vLLM's own bound, from the device
    assert cache.committable_blocks() == admitted < own_warm_up
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(multimodal_config=None), parallel_config=SimpleNamespace(),
                                  cache_config=SimpleNamespace(gpu_memory_utilization=None))
    measure = dict(init_free_memory=device_reads.free_bytes, requested_memory=device_reads.total_bytes)
    own_final = ekv.measure_kv_cache_blocks.__wrapped__(cache, vllm_config, DEVICE, **measure)
    final = ekv.measure_kv_cache_blocks(cache, vllm_config, DEVICE, **measure)
    assert final == admitted < own_final  # the scheduler gets what the broker admitted: misses, not a failed commit

    from vllm.v1.worker.gpu_worker import Worker

    def vllms_extend(self, num_blocks):  # stands in for extend_kv_cache's body: the final commit
        self.model_runner.extensible_kv_cache.commit(num_blocks, shrink=True)

    runner = SimpleNamespace(extensible_kv_cache=cache)
    extensible.wrap_extend_kv_cache(vllms_extend)(SimpleNamespace(model_runner=runner), final)
    pools, holds = charged(gpu_broker)
    assert holds == {} and pools["kv_extensible"] == cache.physical_bytes == cache.physical_bytes_for(final)
    from vllm.v1.worker import gpu_worker

    assert getattr(Worker.extend_kv_cache, "__kvcached_broker_wrapped__", False)  # the real method is wrapped
    bound = gpu_worker.measure_kv_cache_blocks  # the binding the warm-up calls: ours, around vLLM's own
    assert getattr(bound, "__kvcached_broker_wrapped__", False)
    assert bound.__wrapped__ is ekv.measure_kv_cache_blocks.__wrapped__
    assert gpu_broker.status()["free_bytes"] == GIB - WEIGHTS - cache.physical_bytes  # the rest was given back

    cache.commit(cache.min_committed_blocks, shrink=True)  # past its final size, a shrink gives memory back
    assert charged(gpu_broker)[0]["kv_extensible"] == cache.physical_bytes
    assert gpu_broker.status()["free_bytes"] == GIB - WEIGHTS - cache.physical_bytes
    cache.free()
    assert "kv_extensible" not in charged(gpu_broker)[0] and driver.physical_bytes == 0


def test_a_commit_beyond_what_the_broker_admits_is_refused_before_anything_maps(driver, gpu_broker):
    """A cache planned without sizing first (no hold: the broker was reached only later) commits
    what the broker admits as growth; past it, the commit fails as vLLM's failed commit does
    (a RuntimeError, here the broker's refusal) with nothing mapped."""
    _, cache = new_cache(256 * MIB)
    pools, holds = charged(gpu_broker)
    assert holds == {} and pools == {"runtime_base": WEIGHTS, "kv_extensible": cache.physical_bytes}
    neighbour = BrokerClient.connect("sglang-neighbour", endpoint=gpu_broker.endpoint, credit_pages=0)
    try:
        neighbour.reserve({"weights": gpu_broker.status()["free_bytes"] - 64 * MIB})  # 64 MiB left
        cache.commit(cache.blocks_within(32 * MIB))  # admitted as growth
        mapped, creates = driver.physical_bytes, len(driver.creates)
        assert charged(gpu_broker)[0]["kv_extensible"] == mapped == cache.physical_bytes
        with pytest.raises(kv_budget.KVCacheBudgetError) as caught:
            cache.commit(cache.blocks_within(128 * MIB))
    finally:
        neighbour.close()
    message = str(caught.value)
    assert isinstance(caught.value, RuntimeError)
    assert "extensible KV cache" in message and gpu_broker.endpoint in message and "sglang-neighbour" in message
    assert len(driver.creates) == creates and driver.physical_bytes == mapped  # the refused commit mapped nothing
    assert charged(gpu_broker)[0]["kv_extensible"] == mapped


def test_the_start_up_in_vllms_order_ends_with_the_cache_and_the_slack_charged_and_no_hold(
        driver, gpu_broker, device_reads):
    """determine_available_memory -> the cache allocated -> warm-up commits, gives them up, captures
    graphs -> compile_or_warm_up_model ends (the warm-up settled) -> the final size measured and
    committed: at the end the broker charges the base, the slack kept and the cache, and holds nothing."""
    slack, graphs = 96 * MIB, 32 * MIB
    w, kv_bytes = sized(GIB, slack_bytes=slack)
    assert charged(gpu_broker)[1] == {"runtime_slack_hold": slack, "kv_sizing_hold": kv_bytes}
    assert kv_bytes == GIB - WEIGHTS - slack  # capped: the slack is held beside it
    _, cache = new_cache(kv_bytes)

    def vllms_warm_up(self):  # stands in for _compile_or_warm_up_model's body on the extensible cache
        cache.commit(cache.committable_blocks())
        cache.commit(cache.min_committed_blocks, shrink=True)
        driver._measured.set(os.getpid(), WEIGHTS + driver.physical_bytes + graphs)  # CUDA graphs captured

    kv_sizing.wrap_compile_or_warm_up_model(vllms_warm_up)(w)
    pools, holds = charged(gpu_broker)
    assert holds == {"kv_sizing_hold": kv_bytes - cache.physical_bytes}
    assert pools["runtime_base"] == WEIGHTS + graphs and pools["runtime_slack"] == slack - graphs
    final = cache.blocks_within(kv_bytes)
    extensible.wrap_extend_kv_cache(lambda self, n: cache.commit(n, shrink=True))(
        SimpleNamespace(model_runner=SimpleNamespace(extensible_kv_cache=cache)), final)
    pools, holds = charged(gpu_broker)
    assert holds == {} and pools == {"runtime_base": WEIGHTS + graphs, "runtime_slack": slack - graphs,
                                     "kv_extensible": cache.physical_bytes}
    assert me(gpu_broker)["phase"] == "serving"


def test_a_sleeping_cache_is_not_charged_and_a_refused_wake_maps_nothing(driver, gpu_broker):
    _, kv_bytes = sized(128 * MIB)
    _, cache = new_cache(kv_bytes)
    extensible.wrap_extend_kv_cache(lambda self, n: cache.commit(n, shrink=True))(
        SimpleNamespace(model_runner=SimpleNamespace(extensible_kv_cache=cache)), cache.blocks_within(kv_bytes))
    committed = cache.physical_bytes
    worker_ = SimpleNamespace(device=torch.device("cpu"))
    memory_release.wrap_sleep(lambda self, level: cache.release_physical())(worker_, 1)  # vLLM's sleep releases it
    assert "kv_extensible" not in charged(gpu_broker)[0] and driver.physical_bytes == 0

    neighbour = BrokerClient.connect("sglang-neighbour", endpoint=gpu_broker.endpoint, credit_pages=0)
    wake = memory_release.wrap_wake_up(lambda self, tags: cache.recommit())  # vLLM's wake commits it again
    try:
        neighbour.reserve({"weights": gpu_broker.status()["free_bytes"] - committed // 2})
        with pytest.raises(kv_budget.KVCacheBudgetError):
            wake(worker_, ["kv_cache"])
        assert driver.physical_bytes == 0  # refused before vLLM committed anything
        neighbour.reserve({})
        wake(worker_, None)
    finally:
        neighbour.close()
    assert driver.physical_bytes == cache.physical_bytes == committed
    assert charged(gpu_broker)[0]["kv_extensible"] == committed
    assert all(charged_pool >= mapped for mapped, charged_pool in driver.creates)
