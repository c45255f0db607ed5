"""KV sizing from the broker: SGLang's real profile is capped, held, and charged once built.

The profile is the installed SGLang's ``_profile_available_bytes`` (``KVCacheConfigurator`` in
0.5.16+, ``ModelRunnerKVCacheMixin`` before) fed a simulated free-memory figure, since CUDA's
free memory does not exist here.  DeepSeek-V4 pools are sized to the granted budget by the
test's stand-in for SGLang's pool configurator (``sglang_cpu.dsv4_units_for``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import sglang_cpu
import torch
from helpers import GIB, MIB
from kvcached_broker.adapters.sglang import kv_budget, kv_sizing, reporting
from kvcached_broker.client import BrokerClient

pytestmark = pytest.mark.runtime("sglang")

WORKER = os.path.join(os.path.dirname(__file__), "sglang_worker.py")


def _pools(status: dict, name: str = "under-test") -> dict:
    return next((i["pools"] for i in status["instances"] if i["name"] == name), {})


@pytest.fixture
def neighbour(sg_broker):
    """Another instance on the same GPU, holding 700 MiB."""
    client = BrokerClient.connect("neighbour", endpoint=sg_broker.endpoint, credit_pages=0)
    client.reserve({"weights": 700 * MIB})
    yield client
    client.close()


def _profile_class():
    if sglang_cpu.at_least("0.5.16"):
        from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

        return KVCacheConfigurator
    from sglang.srt.model_executor.model_runner_kv_cache_mixin import (
        ModelRunnerKVCacheMixin,
    )

    return ModelRunnerKVCacheMixin


def test_the_real_profile_is_patched_where_sglang_sizes_its_kv(patched_sglang):
    cls = _profile_class()
    for name in ("_profile_available_bytes", "_resolve_memory_pool_config", "_init_pools"):
        assert getattr(vars(cls)[name], "__kvcached_broker_wrapped__", False), name


def test_room_is_not_lowered_when_the_broker_has_it(sg_broker):
    assert sglang_cpu.profile(100 * MIB) == 100 * MIB  # SGLang's own figure, untouched
    assert _pools(sg_broker.status()) == {"kv_sizing_hold": 100 * MIB}  # and held until the pools exist


def test_the_profile_is_capped_at_what_the_broker_can_grant_then_charged_per_pool(sg_broker, neighbour):
    kv_bytes = sglang_cpu.profile(900 * MIB)  # the device looks nearly empty to SGLang
    assert kv_bytes == GIB - 700 * MIB and kv_sizing.last_decision().lowered
    assert _pools(sg_broker.status()) == {"kv_sizing_hold": kv_bytes}
    units = sglang_cpu.dsv4_units_for(kv_bytes)
    pool = sglang_cpu.build_dsv4_pool(4 * units, units)
    kv_sizing.charge_pools("cpu", 0, pool)
    pools = _pools(sg_broker.status())
    assert pools == sglang_cpu.tensor_bytes_by_pool(pool)  # the hold is gone, the real pools are charged
    assert 0.9 * kv_bytes < sum(pools.values()) <= kv_bytes
    assert sg_broker.status()["reserved_bytes"] <= GIB


def test_the_floors_of_other_instances_are_left_alone(sg_broker):
    with sg_broker.admin() as admin:
        admin.limit("guaranteed", min_bytes=600 * MIB)
    assert sglang_cpu.profile(900 * MIB) == GIB - 600 * MIB


def test_nothing_grantable_is_a_startup_error_naming_the_broker_budget_and_others(sg_broker):
    other = BrokerClient.connect("big-model", endpoint=sg_broker.endpoint, credit_pages=0)
    try:
        other.reserve({"swa_kv_pool": GIB})
        with pytest.raises(kv_budget.BrokerBudgetError) as caught:
            sglang_cpu.profile(900 * MIB)
    finally:
        other.close()
    message = str(caught.value)
    assert sg_broker.endpoint in message and "under-test" in message
    assert "budget 1.00 GiB" in message and "big-model 1.00 GiB" in message and "\n" not in message


def test_a_runtime_that_cannot_size_its_pool_from_the_capped_budget_fails_with_the_broker_context(
    sg_broker, neighbour, monkeypatch
):
    from sglang.srt.model_executor import pool_configurator

    class TooSmall:  # the runtime's configurator, refusing the budget it was handed
        def calculate_pool_sizes(self, available_bytes, page_size):
            raise RuntimeError(f"Not enough memory for a KV pool: {available_bytes} bytes")

    monkeypatch.setattr(pool_configurator, "create_memory_pool_configurator", lambda owner: TooSmall())
    obj = sglang_cpu.profiler(900 * MIB)
    with sglang_cpu.runtime_config(mem_fraction_static=0.9), pytest.raises(kv_budget.BrokerBudgetError) as caught:
        obj._resolve_memory_pool_config(0)
    message = str(caught.value)
    assert "Not enough memory for a KV pool" in message and sg_broker.endpoint in message
    assert "neighbour 700.00 MiB" in message


def test_a_static_kv_pool_is_charged_as_kv_static(sg_broker):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(1024, 16, torch.bfloat16, 4, 64, 3, "cpu", False)
    reporting.hold(kv_sizing_identity(), 64 * MIB)
    kv_sizing.charge_pools("cpu", 0, pool)
    k_bytes, v_bytes = pool.get_kv_size_bytes()
    charged = _pools(sg_broker.status())
    assert charged == {"kv_static": sglang_cpu.unique_storage_bytes(pool)}  # the hold is gone too
    assert k_bytes + v_bytes <= charged["kv_static"] < k_bytes + v_bytes + 4096  # plus its pointer tables


def kv_sizing_identity():
    from kvcached_broker.adapters.sglang import parallel

    return parallel.identity("cpu")


# ------------------------------------------------------------------ co-located model processes
def _together(endpoint: str, instance: str, free_bytes: int, pre_load_bytes: int) -> subprocess.Popen:
    # the refused one does not wait for the other's start-up to settle (this one never goes on
    # past sizing): that wait is test_adapter_sizing's
    env = {**os.environ, "ENABLE_KVCACHED": "1", "KVCACHED_BROKER": endpoint, "KVCACHED_BROKER_INSTANCE": instance,
           "KVCACHED_BROKER_STARTUP_WAIT_S": "0"}
    return subprocess.Popen([sys.executable, WORKER, "together", str(free_bytes), str(pre_load_bytes)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _read(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    assert line, proc.stderr.read()[-3000:]
    return json.loads(line)


def test_two_models_with_30_gib_of_weights_each_sizing_at_once_stay_within_80_gib(broker_factory):
    """The issue's check: on an 80 GiB device that measures each process (30 GiB of weights
    each, as NVML would report them), two processes size their KV cache through SGLang's real
    ``_profile_available_bytes`` at the same moment.  Each profile sees the device as if it were
    alone (50 GiB free, 80 GiB before its weights): 42 GiB of KV and 8 GiB of slack for its
    activations and CUDA graphs (``mem_fraction_static`` 0.9).  The broker has 20 GiB: the
    first to ask holds the 8 GiB slack and 12 GiB of KV, the other cannot start."""
    from device_usage import MeasuredUsage, instance_of, session_of

    broker = broker_factory(simulate="80GiB", extra_args=["--headroom", "0"])
    device = MeasuredUsage(broker.endpoint)
    procs = [_together(broker.endpoint, name, 50 * GIB, 80 * GIB) for name in ("model-a", "model-b")]
    try:
        pids = [_read(proc)["pid"] for proc in procs]  # both sessions open, nothing sized yet
        for pid in pids:
            device.set(pid, 30 * GIB)  # the weights each process loaded
        assert broker.status()["free_bytes"] == 20 * GIB
        for proc in procs:  # the moment: both size at once
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outcomes = [_read(proc) for proc in procs]
        status = broker.status()
    finally:
        for proc in procs:
            proc.stdin.close()
        codes = [proc.wait(timeout=60) for proc in procs]
    sized = [o.get("kv_bytes", 0) for o in outcomes]
    assert sorted(sized) == [0, 12 * GIB]  # one gets the 20 GiB the broker had, slack first; the other nothing
    assert sum(sized) + 8 * GIB + 60 * GIB <= status["budget_bytes"] == 80 * GIB and not status["overcommitted"]
    winner, loser = (0, 1) if sized[0] else (1, 0)
    assert sorted(codes) == [0, 3] and codes[loser] == 3  # the refused start stops
    held = session_of(status, pids[winner])
    assert held["holds"] == {"kv_sizing_hold": 12 * GIB, "runtime_slack_hold": 8 * GIB}  # on top of the weights
    assert held["pools"] == {"runtime_base": 30 * GIB, **held["holds"]} and held["measured_bytes"] == 30 * GIB
    assert held["phase"] == "sizing"
    assert instance_of(status, pids[winner])["charged_bytes"] == 50 * GIB
    assert session_of(status, pids[loser])["holds"] == {} and status["free_bytes"] == 0
    error = outcomes[loser]["error"]
    names = ("model-a", "model-b")
    assert broker.endpoint in error and names[loser] in error and "a KV cache of up to 42.00 GiB" in error
    assert "8.00 GiB beside it for activations and CUDA graphs" in error and "0 B free on GPU 0" in error
    assert "budget 80.00 GiB" in error and f"held by {names[winner]} 50.00 GiB" in error and "\n" not in error
    assert f"start-ups in progress hold 20.00 GiB ({names[winner]})" in error
