"""A vLLM instance and an SGLang instance sharing one simulated GPU, side by side in status.

Each runs in its own process with its own upstream overlay (vLLM from this run's overlay,
SGLang from ``.adapter-envs/sglang-0.5.23``), both with ``ENABLE_KVCACHED=1`` and pointed at
one real broker.
"""

from __future__ import annotations

import pytest
import os
import subprocess
import sys

from helpers import MIB, adapter_line
from overlays import HERE, SGLANG_ENV, base_env, overlay_env, overlay_version, require_sglang_overlay, spawn

from kvcached_broker.adapters import support
from kvcached_broker.adapters.versions import installed

pytestmark = pytest.mark.runtime("vllm")


def test_vllm_and_sglang_instances_share_one_gpu_side_by_side(broker_factory):
    require_sglang_overlay()
    b = broker_factory(simulate="8GiB", extra_args=["--headroom", "0"])
    base = base_env()
    common = {"ENABLE_KVCACHED": "1", "KVCACHED_REQUIRE": "1", "KVCACHED_BROKER": b.endpoint}
    vllm_env = {**os.environ, **common, "KVCACHED_BROKER_INSTANCE": "vllm-dsv4"}
    sglang_env = {**base, **overlay_env(SGLANG_ENV), **common, "KVCACHED_BROKER_INSTANCE": "sglang-dsv4"}
    vllm_proc, vllm_out = spawn([str(HERE / "vllm_worker.py"), str(64 * MIB)], vllm_env)
    sglang_proc, sglang_out = spawn([str(HERE.parent / "sglang" / "sglang_worker.py"), "dsv4", "4", "2"], sglang_env)
    try:
        assert vllm_out["hook"] and sglang_out["hook"]  # both patched themselves through the .pth hook
        status = b.status()
        by_name = {i["name"]: i for i in status["instances"]}
        assert set(by_name) == {"vllm-dsv4", "sglang-dsv4"}
        vllm_inst, sglang_inst = by_name["vllm-dsv4"], by_name["sglang-dsv4"]
        assert vllm_inst["pools"] == {"kv_static": vllm_out["buffer_bytes"]}  # one buffer, charged once
        assert vllm_inst["usage_breakdown"]  # its cache groups, shown and not charged
        assert vllm_inst["sessions"][0]["pid"] == vllm_out["pid"]
        assert {"swa_kv_pool", "c4_kv_pool", "c128_kv_pool", "c4_indexer_kv_pool"} <= set(sglang_out["pools"])
        assert sglang_inst["pools"] == sglang_out["pools"]  # every V4 side pool at its tensors' size
        assert sglang_inst["sessions"][0]["pid"] == sglang_out["pid"]
        assert status["reserved_bytes"] == vllm_out["buffer_bytes"] + sum(sglang_out["pools"].values())
        assert status["free_bytes"] == status["budget_bytes"] - status["reserved_bytes"] - status["granted_bytes"]
        table = subprocess.run([sys.executable, "-m", "kvcached_broker.broker.cli", "status", "--endpoint", b.endpoint],
                               capture_output=True, text=True, env=base)
        assert "vllm-dsv4" in table.stdout and "sglang-dsv4" in table.stdout and "swa_kv_pool" in table.stdout
        adapters = {name: inst["sessions"][0]["adapter"] for name, inst in by_name.items()}
        assert adapters["vllm-dsv4"]["runtime"] == "vllm" and adapters["sglang-dsv4"]["runtime"] == "sglang"
        assert adapters["vllm-dsv4"]["runtime_version"] == installed("vllm")
        assert adapters["sglang-dsv4"]["runtime_version"] == overlay_version(SGLANG_ENV)
        runner = "vllm_kv_alloc_attn_utils" if support.VLLM.at_least("v2_runner_only", installed("vllm")) \
            else "vllm_kv_alloc_model_runner"  # the GPU model runner this process allocated through
        assert runner in adapters["vllm-dsv4"]["patches"]
        assert {"sglang_dsv4_pool_reservation", "sglang_paged_allocator"} <= set(adapters["sglang-dsv4"]["patches"])
    finally:
        for proc in (vllm_proc, sglang_proc):
            proc.stdin.close()
            proc.wait(timeout=30)
    assert b.status()["instances"] == []  # both sessions closed or reclaimed when the processes ended
    # One line each on stderr, past vLLM's logging configuration (its own logger, propagate=False)
    # and SGLang's (configure_logger at --log-level error): runtime, version, patches, endpoint, instance.
    for proc, name, adapter in ((vllm_proc, "vllm-dsv4", adapters["vllm-dsv4"]),
                                (sglang_proc, "sglang-dsv4", adapters["sglang-dsv4"])):
        err = proc.stderr.read().splitlines()
        (line,) = [line for line in err if "event=adapter_active" in line]
        assert adapter_line(line, "INFO", "adapter_active")
        patched = [line for line in err if "event=patch " in line]  # INFO, past the runtime's logging too
        assert patched and all(adapter_line(line, "INFO", "patch") for line in patched)
        assert f"runtime={adapter['runtime']} version={adapter['runtime_version']}" in line
        assert f"instance={name}" in line and f"endpoint={b.endpoint}" in line and "hook=pth" in line
        assert f"patches={','.join(adapter['patches'])}" in line
