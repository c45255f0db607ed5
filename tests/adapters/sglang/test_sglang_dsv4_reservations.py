"""DeepSeek-V4 runtime-owned pools reported per pool, measured from the real tensors.

The pools are the installed SGLang's ``DeepSeekV4TokenToKVPool`` built on CPU; the expected
sizes are the test's own per-attribute sums (``sglang_cpu.tensor_bytes_by_pool``).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest

import sglang_cpu
from helpers import MIB, wait_for

from kvcached_broker.adapters import background, process_state, sessions
from kvcached_broker.adapters.sglang import dsv4_pools, dsv4_reservation, pool_bytes, parallel

pytestmark = pytest.mark.runtime("sglang")

WORKER = os.path.join(os.path.dirname(__file__), "sglang_worker.py")


def _instance(status: dict, name: str = "under-test") -> dict:
    return next(i for i in status["instances"] if i["name"] == name)


def test_each_pool_is_reported_with_its_tensor_bytes(sg_broker):
    pool = sglang_cpu.build_dsv4_pool(full_pages=64, swa_pages=16)
    expected = sglang_cpu.tensor_bytes_by_pool(pool)
    assert {"swa_kv_pool", "c4_kv_pool", "c128_kv_pool", "c4_indexer_kv_pool", "compress_state_pools",
            "indexer_compress_state_pools"} <= set(expected)
    inst = _instance(sg_broker.status())
    assert inst["pools"] == expected
    assert inst["reserved_bytes"] == sum(expected.values()) == sglang_cpu.unique_storage_bytes(pool)
    assert inst["reserved_bytes"] == _buf_info_bytes(pool)  # SGLang's own transfer-buffer byte lengths


def test_a_pools_report_reaches_the_broker_client_without_coming_back_to_a_module(sg_broker):
    """The path one DeepSeek-V4 pool takes from SGLang's pool constructor to the broker client's
    ``reserve``, as a call stack: the patch, the SGLang reporter, the device's session, the
    client, each entered once (a module that called out and was called back, as the old
    session guard called back into its caller, shows up twice)."""
    stacks = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "reserve" and not stacks \
                and frame.f_globals.get("__name__", "").startswith("kvcached_broker.client"):
            modules, f = [], frame
            while f is not None:
                name = f.f_globals.get("__name__", "")
                if name.startswith("kvcached_broker.") and (not modules or modules[-1] != name):
                    modules.append(name)
                f = f.f_back
            stacks.append(modules[::-1])

    sys.setprofile(profile)
    try:
        sglang_cpu.build_dsv4_pool(full_pages=64, swa_pages=16)
    finally:
        sys.setprofile(None)
    (path,) = stacks
    assert [m.removeprefix("kvcached_broker.") for m in path] == [
        "adapters.sglang.dsv4_reservation", "adapters.sglang.reporting", "adapters.device_session",
        "client.sync_client"]


def _buf_info_bytes(pool) -> int:
    methods = ("get_contiguous_buf_infos", "get_state_buf_infos", "get_request_state_buf_infos",
               "get_unified_swa_ring_buf_infos", "get_swa_valid_from_buf_infos")
    return sum(sum(getattr(pool, m)()[1]) for m in methods if hasattr(pool, m))


@pytest.mark.skipif(not sglang_cpu.at_least("0.5.20"), reason="kv_pools/index_pools dicts arrived in 0.5.20")
def test_alias_attributes_are_counted_once(sg_broker):
    pool = sglang_cpu.build_dsv4_pool(full_pages=8, swa_pages=4)
    assert pool.c4_kv_pool is pool.kv_pools[4] and pool.c4_indexer_kv_pool is pool.index_pools[4]
    measured = sum(dsv4_pools.measure(pool).values())
    names = ["swa_kv_pool", "c4_kv_pool", "c128_kv_pool", "c4_indexer_kv_pool", "kv_pools", "index_pools",
             "compress_state_pools", "indexer_compress_state_pools"]
    naive = sum(pool_bytes.object_bytes(getattr(pool, name)) for name in names)  # no dedup across names
    aliases = sum(pool_bytes.object_bytes(getattr(pool, n)) for n in ("c4_kv_pool", "c128_kv_pool", "c4_indexer_kv_pool"))
    assert measured == sglang_cpu.unique_storage_bytes(pool)
    assert aliases > 0 and naive == measured + aliases

@pytest.mark.skipif(not sglang_cpu.at_least("0.5.21"), reason="the DSV4.1 request window arrived in 0.5.21")
def test_the_request_window_is_a_pool_and_is_measured_again_when_its_workspace_grows(sg_broker):
    pool = sglang_cpu.build_dsv4_pool(full_pages=16, swa_pages=4, request_window=True)
    assert pool.swa_kv_pool is None
    before = _instance(sg_broker.status())["pools"]
    assert before == sglang_cpu.tensor_bytes_by_pool(pool) and "request_window" in before
    window = pool.request_window
    window._ensure_workspace(window.workspace.size * 4)  # SGLang grows it lazily, inside a forward pass
    assert background.drain()  # measured again off the forward pass, on the adapter's own thread
    after = _instance(sg_broker.status())["pools"]
    assert after == sglang_cpu.tensor_bytes_by_pool(pool)
    assert after["request_window"] > before["request_window"]


def test_a_managed_sub_pool_is_not_reserved(sg_broker):
    pool = sglang_cpu.build_dsv4_pool(full_pages=8, swa_pages=4)
    pool_bytes.mark_managed(pool.swa_kv_pool)  # as if kvcached or the broker managed the SWA pool
    dsv4_reservation.register(pool)
    pools = _instance(sg_broker.status())["pools"]
    expected = sglang_cpu.tensor_bytes_by_pool(pool)
    assert "swa_kv_pool" not in pools and "dsv4_other" not in pools
    assert pools == {k: v for k, v in expected.items() if k != "swa_kv_pool"}


def test_a_rebuilt_pool_replaces_the_old_one_and_zero_removes_a_pool(sg_broker):
    first = sglang_cpu.build_dsv4_pool(full_pages=16, swa_pages=4)
    assert "c128_kv_pool" in _instance(sg_broker.status())["pools"]
    second = sglang_cpu.build_dsv4_pool(full_pages=32, swa_pages=8, ratios=(4, 4, 4, 4))
    del first
    gc.collect()
    expected = sglang_cpu.tensor_bytes_by_pool(second)
    pools = wait_for(lambda: (p := _instance(sg_broker.status())["pools"]) == expected and p, what="old pool forgotten")
    assert "c128_kv_pool" not in pools and "compress_state_pools" in pools  # the C128 pools went to 0


def test_the_flag_switches_reporting_off_when_the_pool_is_built(sg_broker, monkeypatch):
    monkeypatch.setenv("KVCACHED_SGLANG_DSV4_RUNTIME_RESERVATION", "0")
    sglang_cpu.build_dsv4_pool(full_pages=8, swa_pages=4)
    assert all(i["reserved_bytes"] == 0 for i in sg_broker.status()["instances"])
    monkeypatch.setenv("KVCACHED_SGLANG_DSV4_RUNTIME_RESERVATION", "1")
    kept = sglang_cpu.build_dsv4_pool(full_pages=8, swa_pages=4)
    assert _instance(sg_broker.status())["pools"] == sglang_cpu.tensor_bytes_by_pool(kept)


def test_require_with_an_unreachable_broker_fails_the_pool_build(adapter_state, patched_sglang, monkeypatch, short_tmp):
    monkeypatch.setenv("KVCACHED_BROKER", f"ipc://{short_tmp}/nobody{{device}}.sock")
    monkeypatch.setenv("KVCACHED_BROKER_TIMEOUT_S", "0.3")
    monkeypatch.setenv("KVCACHED_REQUIRE", "1")
    with pytest.raises(sessions.BrokerRequired, match=r"KVCACHED_REQUIRE=1.*device 0"):
        sglang_cpu.build_dsv4_pool(full_pages=8, swa_pages=4)
    monkeypatch.delenv("KVCACHED_REQUIRE")
    process_state.reset()
    assert sglang_cpu.build_dsv4_pool(full_pages=8, swa_pages=4) is not None  # unprotected, with a warning


def test_cpu_pools_map_to_device_zero_and_cuda_ordinals_are_kept():
    assert parallel.device_index("cpu") == 0 and parallel.device_index("cuda:3") == 3 and parallel.device_index("cuda", 2) == 2
    assert parallel.tp_group().size == 1  # SGLang's parallel state is not initialised in this process


# ------------------------------------------------------------------ several real processes
def _start(endpoint: str, instance: str, full_pages: int, swa_pages: int, explicit: bool) -> subprocess.Popen:
    env = {**os.environ, "KVCACHED_BROKER": endpoint, "KVCACHED_BROKER_INSTANCE": instance}
    env.pop("KVCACHED_REQUIRE", None)
    if explicit:
        env.pop("ENABLE_KVCACHED", None)
        env.pop("KVCACHED_AUTOPATCH", None)
    else:
        env["ENABLE_KVCACHED"] = "1"  # the .pth startup hook applies the patches on import
    args = [sys.executable, WORKER, "dsv4", str(full_pages), str(swa_pages)] + (["--explicit-apply"] if explicit else [])
    return subprocess.Popen(args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _status_json(endpoint: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "kvcached_broker.broker.cli", "status", "--endpoint", endpoint,
                          "--json"], capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_several_processes_report_their_pools_to_a_simulated_gpu_broker(broker_factory):
    broker = broker_factory(simulate="2GiB")
    shapes = {"dsv4-a": (64, 16, False), "dsv4-c": (32, 8, True)}  # two processes: the .pth hook and explicit
    procs = {name: _start(broker.endpoint, name, full, swa, explicit) for name, (full, swa, explicit) in shapes.items()}
    try:
        reports = {}
        for name, proc in procs.items():
            line = proc.stdout.readline()
            assert line, f"{name} died: {proc.stderr.read()[-2000:]}"
            reports[name] = json.loads(line)
        status = _status_json(broker.endpoint)
        by_name = {i["name"]: i for i in status["instances"]}
        for name, report in reports.items():
            assert report["hook"] is (not shapes[name][2])  # .pth hook ran exactly where the flag was set
            assert by_name[name]["pools"] == report["pools"], name
            assert by_name[name]["sessions"][0]["pid"] == report["pid"]
        assert status["reserved_bytes"] == sum(sum(r["pools"].values()) for r in reports.values())
        assert reports["dsv4-a"]["pools"]["swa_kv_pool"] > reports["dsv4-c"]["pools"]["swa_kv_pool"]
        for name in reports:  # the adapter that opened each session, per session
            adapter = by_name[name]["sessions"][0]["adapter"]
            assert adapter["runtime"] == "sglang" and adapter["runtime_version"] == sglang_cpu.SGLANG
            assert "sglang_dsv4_pool_reservation" in adapter["patches"]
    finally:
        for proc in procs.values():
            proc.stdin.close()
        for proc in procs.values():
            proc.wait(timeout=60)
    wait_for(lambda: _status_json(broker.endpoint)["reserved_bytes"] == 0, what="pools freed with their processes")
    assert MIB < min(sum(r["pools"].values()) for r in reports.values())
    for name, proc in procs.items():  # one line each, though SGLang's logging runs at --log-level error
        (line,) = [line for line in proc.stderr.read().splitlines() if "event=adapter_active" in line]
        assert f"runtime=sglang version={sglang_cpu.SGLANG}" in line and f"instance={name}" in line
        assert f"endpoint={broker.endpoint}" in line and "sglang_dsv4_pool_reservation" in line
        assert ("hook=explicit" if shapes[name][2] else "hook=pth") in line
