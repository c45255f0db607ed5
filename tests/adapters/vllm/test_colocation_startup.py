"""A co-located start-up: two SGLang instances and one vLLM instance size at the same moment.

On a simulated 80 GiB GPU (headroom 0) that measures each process as NVML would, the three
have loaded 30, 30 and 15 GiB of weights: 5 GiB is left, and each runtime's own figure is
far more (each SGLang profile sees the device as if it were alone: 50 GiB free, 10 GiB
before its weights, so 1 GiB of slack beside a 49 GiB KV cache; vLLM profiled 57 GiB, 90%
of the device less its weights).  Each runs in
its own process with its own overlay (vLLM from this run's, SGLang 0.5.23), ``ENABLE_KVCACHED=1``,
through the runtime's real sizing path; each opens its session, then all are told to size at
once (a line on every stdin once all are ready: an event, not a sleep).
"""

from __future__ import annotations

import pytest
from helpers import GIB
from overlays import SGLANG_WORKER, VLLM_WORKER, read_json, require_sglang_overlay, sglang_env, start, vllm_env

from device_usage import MeasuredUsage, instance_of, session_of

from kvcached_broker.adapters import support
from kvcached_broker.adapters.versions import installed, parse

pytestmark = pytest.mark.runtime("vllm")

#: The co-location start-up runs once, in the newest vLLM overlay: its vLLM side is the same
#: sizing wrapper on every release, and test_vllm_sizing runs each release's Worker on a
#: measuring device.  (Three runtime processes cost about 35 s on the 2-vCPU machine.)
NEWEST_VLLM = support.VLLM.tested()[-1]

#: instance -> (runtime, weights the device measures, what the runtime's own sizing asks for)
INSTANCES = {
    "sglang-a": ("sglang", 30 * GIB, 50 * GIB),
    "sglang-b": ("sglang", 30 * GIB, 50 * GIB),
    "vllm-c": ("vllm", 15 * GIB, 57 * GIB),
}
#: what an SGLang instance keeps beside its KV cache: 10 GiB before its weights x (1 - 0.9)
SGLANG_SLACK = GIB


def _start(endpoint: str, name: str):
    runtime, _, asks_bytes = INSTANCES[name]
    # a refused one does not wait for the others' start-ups to settle (these never go on past
    # sizing): that wait is test_adapter_sizing's
    common = {"ENABLE_KVCACHED": "1", "KVCACHED_BROKER": endpoint, "KVCACHED_BROKER_INSTANCE": name,
              "KVCACHED_BROKER_STARTUP_WAIT_S": "0"}
    if runtime == "sglang":
        return start([str(SGLANG_WORKER), "together", str(asks_bytes), str(10 * GIB)], sglang_env(**common))
    return start([str(VLLM_WORKER), "together", str(asks_bytes)], vllm_env(**common))


@pytest.mark.skipif(parse(installed("vllm") or "0") < parse(NEWEST_VLLM),
                    reason=f"the co-location start-up runs in the vLLM {NEWEST_VLLM} overlay")
def test_three_instances_sizing_at_once_never_overbook_and_the_refused_ones_say_why(broker_factory):
    require_sglang_overlay()
    broker = broker_factory(simulate="80GiB", extra_args=["--headroom", "0"])
    device = MeasuredUsage(broker.endpoint)
    procs = {name: _start(broker.endpoint, name) for name in INSTANCES}
    try:
        pids = {name: read_json(proc, name)["pid"] for name, proc in procs.items()}  # sessions open
        for name, pid in pids.items():
            device.set(pid, INSTANCES[name][1])  # the weights each loaded
        assert broker.status()["free_bytes"] == 5 * GIB
        for proc in procs.values():  # the moment: all three size at once
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outcomes = {name: read_json(proc, name) for name, proc in procs.items()}
        status = broker.status()
    finally:
        for proc in procs.values():
            proc.stdin.close()
        for proc in procs.values():
            proc.wait(timeout=60)
    sized = {name: o.get("kv_bytes", 0) for name, o in outcomes.items()}
    weights = sum(w for _, w, _ in INSTANCES.values())
    # Whichever asked first holds all 5 GiB (each asks for more), its slack first; nothing is
    # lost, nothing overbooked.
    (started,) = [name for name, size in sized.items() if size]
    slack = SGLANG_SLACK if INSTANCES[started][0] == "sglang" else 0
    assert sized[started] + slack == 5 * GIB
    assert sized[started] + slack + weights == status["budget_bytes"] == 80 * GIB and not status["overcommitted"]
    me = session_of(status, pids[started])
    assert sum(me["holds"].values()) == 5 * GIB and me["pools"]["runtime_base"] == INSTANCES[started][1]
    assert instance_of(status, pids[started])["charged_bytes"] == INSTANCES[started][1] + 5 * GIB
    for name in set(INSTANCES) - {started}:  # the starts that cannot fit fail, naming the broker, the room, the holders
        error = outcomes[name]["error"]
        assert outcomes[name]["event"] == "refused" and broker.endpoint in error and name in error
        assert "\n" not in error and "budget 80.00 GiB" in error and "0 B free" in error
        assert f"{started} {INSTANCES[started][1] // GIB + 5}.00 GiB" in error
        assert f"start-ups in progress hold 5.00 GiB ({started})" in error
        assert session_of(status, pids[name])["holds"] == {}
