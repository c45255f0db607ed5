"""SGLang's release/resume of memory occupation, followed through to the broker.

The methods are the installed release's own (``SchedulerWeightUpdaterManager`` in 0.5.13+,
``SchedulerUpdateWeightsMixin`` in 0.5.12), run on an object that holds what they use; only
torch_memory_saver, which needs CUDA, is a recorder (``sglang_cpu.MemorySaver``) that says it
is enabled and notes what SGLang paused and resumed.  On the simulated GPU that measures this
process as NVML would (``device_usage``), the recorder tells the device what each pause frees
and each resume maps again.  The weights path's TP barrier runs on a real gloo group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

import sglang_cpu
from helpers import GIB, MIB

from kvcached_broker.adapters import sessions
from kvcached_broker.adapters.sglang import kv_budget, parallel
from kvcached_broker.client import BrokerClient

pytestmark = pytest.mark.runtime("sglang")

PID = os.getpid()
WORKER = os.path.join(os.path.dirname(__file__), "sglang_worker.py")
CONTEXT, WEIGHTS, GRAPHS = 32 * MIB, 256 * MIB, 64 * MIB  # what the process uses besides its KV cache


def _pools(status):
    return next((i["pools"] for i in status["instances"] if i["name"] == "under-test"), {})


def _charged(status):
    """What the device is charged for (the neighbour, in this process too, holds nothing then)."""
    return status["budget_bytes"] - status["free_bytes"]


@pytest.fixture
def neighbour(sg_broker):
    client = BrokerClient.connect("neighbour", endpoint=sg_broker.endpoint, credit_pages=0)
    yield client
    client.close()


@pytest.fixture
def gloo_world():
    """A process group of one: SGLang's weights path has a barrier on the TP CPU group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_released_kv_memory_is_no_longer_charged_and_comes_back_through_admission(sg_broker, neighbour):
    pool = sglang_cpu.build_dsv4_pool(full_pages=64, swa_pages=16)
    charged = _pools(sg_broker.status())
    assert charged == sglang_cpu.tensor_bytes_by_pool(pool)
    saver = sglang_cpu.MemorySaver()
    updater = sglang_cpu.weight_updater(saver)

    sglang_cpu.release(updater, ["kv_cache"])
    assert saver.calls == [("pause", "kv_cache")] and _pools(sg_broker.status()) == {}  # no longer charged

    neighbour.reserve({"weights": GIB - sum(charged.values()) // 2})  # takes what was handed back
    with pytest.raises(kv_budget.BrokerBudgetError) as caught:
        sglang_cpu.resume(updater, ["kv_cache"])
    assert sg_broker.endpoint in str(caught.value) and "neighbour" in str(caught.value)
    assert saver.calls == [("pause", "kv_cache")]  # SGLang never mapped memory the broker refused
    assert _pools(sg_broker.status()) == {}
    neighbour.reserve({})
    sglang_cpu.resume(updater, ["kv_cache"])
    assert saver.calls[-1] == ("resume", "kv_cache") and _pools(sg_broker.status()) == charged


def test_a_memory_saver_that_releases_nothing_keeps_the_charge(sg_broker):
    pool = sglang_cpu.build_dsv4_pool(full_pages=16, swa_pages=4)
    updater = sglang_cpu.weight_updater(sglang_cpu.MemorySaver(enabled=False))  # SGLang's no-op adapter
    sglang_cpu.release(updater, ["kv_cache"])
    assert _pools(sg_broker.status()) == sglang_cpu.tensor_bytes_by_pool(pool)
    sglang_cpu.resume(updater, ["kv_cache"])
    assert _pools(sg_broker.status()) == sglang_cpu.tensor_bytes_by_pool(pool)


def test_released_weights_and_cuda_graphs_are_no_longer_charged_and_come_back_through_admission(
    sg_broker, measured, neighbour, gloo_world
):
    measured.set(PID, CONTEXT + WEIGHTS)  # the weights are loaded
    sessions.session(parallel.identity("cpu")).pin_base()  # as KV sizing does, before the pools exist
    pool = sglang_cpu.build_dsv4_pool(full_pages=64, swa_pages=16)
    kv = sglang_cpu.tensor_bytes_by_pool(pool)
    sizes = {"kv_cache": sum(kv.values()), "weights": WEIGHTS, "cuda_graph": GRAPHS}
    mapped = set(sizes)
    measured.set(PID, CONTEXT + sum(sizes.values()))  # the pools are allocated, CUDA graphs captured

    def follow(tag: str, now_mapped: bool) -> None:  # the device measures what each tag frees and maps
        (mapped.add if now_mapped else mapped.discard)(tag)
        measured.set(PID, CONTEXT + sum(sizes[t] for t in mapped))

    saver = sglang_cpu.MemorySaver(on_change=follow)
    updater = sglang_cpu.weight_updater(saver)
    everything = CONTEXT + sum(sizes.values())
    assert _charged(sg_broker.status()) == everything

    sglang_cpu.release(updater)  # every tag
    assert _pools(sg_broker.status()) == {"runtime_base": CONTEXT}  # weights and graphs left the base
    assert _charged(sg_broker.status()) == CONTEXT

    neighbour.reserve({"weights": GIB - CONTEXT - WEIGHTS // 2})  # takes most of what was handed back
    with pytest.raises(kv_budget.BrokerBudgetError) as caught:
        sglang_cpu.resume(updater, ["weights"])
    assert sg_broker.endpoint in str(caught.value) and "neighbour" in str(caught.value)
    assert ("resume", "weights") not in saver.calls  # SGLang never mapped memory the broker refused
    assert _pools(sg_broker.status()) == {"runtime_base": CONTEXT}
    neighbour.reserve({})

    sglang_cpu.resume(updater, ["weights"])  # admitted before mapping; graphs and KV still handed back
    assert _pools(sg_broker.status()) == {"runtime_base": CONTEXT + WEIGHTS}
    assert _charged(sg_broker.status()) == CONTEXT + WEIGHTS
    sglang_cpu.resume(updater, ["kv_cache", "cuda_graph"])
    assert _pools(sg_broker.status()) == {"runtime_base": CONTEXT + WEIGHTS + GRAPHS, **kv}
    assert _charged(sg_broker.status()) == everything and pool is not None


def test_a_resume_refused_for_the_graphs_maps_nothing_and_overbooks_nothing(sg_broker, measured, neighbour,
                                                                            gloo_world):
    measured.set(PID, CONTEXT + WEIGHTS + GRAPHS)
    sessions.session(parallel.identity("cpu")).pin_base()
    mapped = {"weights", "cuda_graph"}

    def follow(tag: str, now_mapped: bool) -> None:
        (mapped.add if now_mapped else mapped.discard)(tag)
        measured.set(PID, CONTEXT + WEIGHTS * ("weights" in mapped) + GRAPHS * ("cuda_graph" in mapped))

    saver = sglang_cpu.MemorySaver(on_change=follow)
    updater = sglang_cpu.weight_updater(saver)
    sglang_cpu.release(updater, ["cuda_graph"])
    assert _pools(sg_broker.status()) == {"runtime_base": CONTEXT + WEIGHTS}
    neighbour.reserve({"weights": GIB - CONTEXT - WEIGHTS - GRAPHS // 2})
    with pytest.raises(kv_budget.BrokerBudgetError):
        sglang_cpu.resume(updater, ["cuda_graph"])
    assert saver.calls == [("pause", "cuda_graph")] and not sg_broker.status()["overcommitted"]


# ------------------------------------------------------------------ tensor parallel, 2 processes
def _tp_workers(endpoints: list[str], port: int, extra_env: list[dict]) -> list[subprocess.Popen]:
    procs = []
    for rank, endpoint in enumerate(endpoints):
        env = {**os.environ, "ENABLE_KVCACHED": "1", "KVCACHED_BROKER": endpoint, "KVCACHED_BROKER_INSTANCE": "tp2",
               **extra_env[rank]}
        procs.append(subprocess.Popen([sys.executable, WORKER, "occupation", str(rank), str(len(endpoints)), str(port)],
                                      env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    return procs


def _step(procs: list[subprocess.Popen]) -> list[dict]:
    """Let every rank take its next step; what each printed."""
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    return [_read(proc) for proc in procs]


def _read(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    assert line, proc.stderr.read()[-3000:]
    return json.loads(line)


@pytest.mark.skipif(not sglang_cpu.at_least("0.5.13"), reason="0.5.12 finds its TP group as 0.5.13 does (suite time)")
@pytest.mark.parametrize("failure", ["evicted", "required_broker_gone"])
def test_a_rank_whose_broker_fails_on_resume_still_joins_the_collective_and_no_rank_resumes(
    failure, inproc_factory
):
    """Rank 1's broker fails between release and resume: both ranks vote in the one min-reduce,
    rank 1 raises its own error after it, rank 0 raises too, and neither maps its memory."""
    brokers = [inproc_factory(total_bytes=GIB, device=0), inproc_factory(total_bytes=GIB, device=1)]
    gone = {"KVCACHED_REQUIRE": "1", "KVCACHED_BROKER_TIMEOUT_S": "3"}  # how long rank 1 waits for a stopped broker
    extra_env = [{}, gone if failure == "required_broker_gone" else {}]
    procs = _tp_workers([b.endpoint for b in brokers], _free_port(), extra_env)
    killer = threading.Timer(180, lambda: [proc.kill() for proc in procs])  # a deadlock fails, not hangs
    killer.start()
    try:
        ready = [_read(proc) for proc in procs]
        kv_pools = brokers[0].status()["instances"][0]["pools"]
        assert kv_pools and [r["error"] for r in _step(procs)] == [None, None]  # released on both ranks
        assert brokers[0].status()["instances"][0]["pools"] == {}
        if failure == "evicted":
            with brokers[1].admin() as admin:
                admin.evict(ready[1]["session"])
        else:
            brokers[1].server.stop()
            brokers[1].thread.join()  # gone: it answers nothing from now on
        resumed = _step(procs)
        after_resume = brokers[0].status()["instances"][0]["pools"]
    finally:
        killer.cancel()
        for proc in procs:
            proc.stdin.close()
        for proc in procs:
            proc.wait(timeout=60)
    assert [r["collectives"] for r in resumed] == [1, 1]  # every rank, once, on every path
    expected = "SessionEvicted" if failure == "evicted" else "BrokerRequired"
    assert [r["error"] for r in resumed] == ["BrokerBudgetError", expected]
    assert "another TP rank" in resumed[0]["message"]
    assert after_resume == {}  # rank 0 handed back again what it was admitted
    assert [proc.returncode for proc in procs] == [0, 0]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
