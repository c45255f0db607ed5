"""The CLI contract (docs/design.md): commands, JSON shape and exit codes, run as real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from kvcached_broker.client import BrokerClient
from kvcached_broker.tools.launch import BrokerLauncher

from helpers import GIB, MIB


def cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvcached_broker.broker.cli", *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )


def test_version():
    out = cli("--version")
    assert out.returncode == 0 and out.stdout.startswith("kvcached-broker ")


def test_status_of_a_missing_broker_exits_3_naming_the_endpoint(short_tmp):
    endpoint = f"ipc://{short_tmp}/nobody.sock"
    out = cli("status", "--endpoint", endpoint)
    assert out.returncode == 3
    assert endpoint in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_status_of_a_silent_socket_exits_3(short_tmp):
    """A socket file with nobody answering (a hung or dead broker) also exits 3, after the timeout."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)  # binds but never answers
    sock.bind(f"ipc://{short_tmp}/silent.sock")
    out = cli("status", "--endpoint", f"ipc://{short_tmp}/silent.sock", "--timeout", "0.5")
    sock.close(0)
    assert out.returncode == 3 and "silent.sock" in out.stderr


def test_status_uses_KVCACHED_BROKER_with_a_device_template(broker):
    template = broker.endpoint.replace("gpu0", "gpu{device}")
    out = cli("status", "--json", env={"KVCACHED_BROKER": template})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["device"]["index"] == 0


@pytest.mark.parametrize(
    "args",
    [
        ["serve", "--simulate", "80GB"],
        ["serve", "--simulate", "lots"],
        ["serve", "--headroom", "120%"],
        ["serve", "--lease", "-1"],
        ["serve", "--endpoint", "ipc://relative.sock"],
        ["status", "--device", "0", "--endpoint", "ipc:///tmp/x.sock"],
        ["limit", "m", "--max", "1.5TB"],
        ["limit", "m", "--weight", "0"],
        ["nonsense"],
    ],
)
def test_usage_errors_exit_2_with_one_line(args):
    out = cli(*args)
    assert out.returncode == 2, out
    assert out.stderr.strip().splitlines()[-1].startswith(("usage:", "kvcached-broker")) or "error" in out.stderr


def test_decimal_units_are_refused_with_a_hint():
    out = cli("serve", "--simulate", "80GB")
    assert out.returncode == 2 and "GiB" in out.stderr and "ambiguous" in out.stderr


def test_status_json_and_table_agree_with_client_holdings(broker):
    with BrokerClient.connect("dsv4", endpoint=broker.endpoint, credit_pages=0) as c:
        c.reserve({"swa_kv_pool": 3 * GIB, "c4_kv_pool": GIB})
        c.acquire(10)
        out = cli("status", "--endpoint", broker.endpoint, "--json")
        assert out.returncode == 0
        doc = json.loads(out.stdout)
        assert doc["reserved_bytes"] == 4 * GIB and doc["granted_bytes"] == 10 * 2 * MIB
        assert doc["free_bytes"] == doc["budget_bytes"] - 4 * GIB - 20 * MIB
        table = cli("status", "--endpoint", broker.endpoint)
        assert table.returncode == 0
        assert "dsv4" in table.stdout and "swa_kv_pool" in table.stdout and "3.00 GiB" in table.stdout
        assert "budget 76.00 GiB" in table.stdout


def test_limit_max_refuses_grants_beyond_it_and_none_clears_it(broker):
    with BrokerClient.connect("noisy", endpoint=broker.endpoint, page_bytes=GIB, credit_pages=0) as c:
        out = cli("limit", "noisy", "--endpoint", broker.endpoint, "--max", "2GiB")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["max_bytes"] == 2 * GIB
        assert c.acquire(3) == 0
        assert c.acquire(2) == 2
        inst = [i for i in broker.status()["instances"] if i["name"] == "noisy"][0]
        assert inst["max_bytes"] == 2 * GIB
        assert cli("limit", "noisy", "--endpoint", broker.endpoint, "--max", "none").returncode == 0
        assert c.acquire(3) == 3
        inst = [i for i in broker.status()["instances"] if i["name"] == "noisy"][0]
        assert inst["max_bytes"] is None


def test_limit_priority_is_kept_shown_and_checked(broker):
    """--priority alone is a limit change (the reclaim order); a bad one is a usage error that
    changes nothing."""
    out = cli("limit", "batch", "--endpoint", broker.endpoint, "--priority", "-7")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["priority"] == -7
    out = cli("limit", "batch", "--endpoint", broker.endpoint, "--weight", "2")
    assert json.loads(out.stdout)["priority"] == -7  # kept when another limit changes
    for bad in ("1001", "x", "1.5"):
        out = cli("limit", "batch", "--endpoint", broker.endpoint, "--priority", bad)
        assert out.returncode == 2 and "--priority" in out.stderr, out.stderr
    (inst,) = [i for i in broker.status()["instances"] if i["name"] == "batch"]
    assert inst["priority"] == -7 and inst["weight"] == 2.0


def test_refused_limit_exits_1_with_limit_exceeded(broker):
    out = cli("limit", "m", "--endpoint", broker.endpoint, "--max", "1GiB", "--min", "2GiB")
    assert out.returncode == 1 and "limit_exceeded" in out.stderr
    out = cli("limit", "m", "--endpoint", broker.endpoint, "--min", "100GiB")
    assert out.returncode == 1 and "limit_exceeded" in out.stderr


def test_evict_of_unknown_session_exits_1(broker):
    out = cli("evict", "s-00000000", "--endpoint", broker.endpoint)
    assert out.returncode == 1 and "s-00000000" in out.stderr


def test_watch_redraws_until_interrupted(broker):
    proc = subprocess.Popen(
        [sys.executable, "-X", "faulthandler", "-m", "kvcached_broker.broker.cli", "status", "--endpoint",
         broker.endpoint, "--watch", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    frames = 0
    for line in proc.stdout:  # wait for the frames themselves, however slow the machine
        frames += "budget 76.00 GiB" in line
        if frames >= 3:
            break
    proc.send_signal(signal.SIGINT)
    try:
        proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        # Abort it, so faulthandler prints where it waits (a handler once deadlocked in a wait: test_interrupt.py).
        proc.send_signal(signal.SIGABRT)
        _, stderr = proc.communicate(timeout=30)
        pytest.fail(f"status --watch did not exit within 60 s of Ctrl-C; its threads:\n{stderr[-6000:]}")
    assert frames >= 3 and proc.returncode == 0  # several frames, each with the bars; ^C ends it cleanly


def test_demo_runs_and_exits_0():
    """The three-worker demo, pinned (``kvcached-broker demo`` shows the mission with kvcached pools
    wherever torch and kvcached are importable; tests/adapters/kvcached/test_mission_demo.py checks that one)."""
    out = cli("demo", "--seconds", "2", env={"KVCACHED_BROKER_DEMO": "classic"}, timeout=60)
    assert out.returncode == 0, out.stderr
    for name in ("deepseek-v4", "llama-a", "llama-b", "swa_kv_pool", "c4_indexer_kv_pool"):
        assert name in out.stdout


def test_status_all_finds_every_broker_of_a_uuid_endpoint_template(short_tmp):
    """The Helm chart's and the DaemonSet's ``KVCACHED_BROKER=ipc:///run/kvcached/{uuid}.sock``:
    ``status --all`` lists the sockets that exist (it once asked the template itself)."""
    from helpers import python_env

    env = {**python_env(), "KVCACHED_BROKER": f"ipc://{short_tmp}/{{uuid}}.sock"}
    uuids = ["GPU-0b1e", "GPU-7f3a"]
    brokers = [BrokerLauncher(f"ipc://{short_tmp}/{uuid}.sock", device=i, simulate=f"{8 * (i + 1)}GiB", env=env)
               for i, uuid in enumerate(uuids)]
    try:
        for b in brokers:
            b.start()
        out = cli("status", "--all", "--json", env=env)
        assert out.returncode == 0, out.stderr
        assert sorted(d["total_bytes"] for d in json.loads(out.stdout)) == [8 * GIB, 16 * GIB]
    finally:
        for b in brokers:
            b.stop()
    gone = cli("status", "--all", "--json", env=env)  # no broker: said in one line
    assert gone.returncode != 0 and "no kvcached-broker sockets" in gone.stderr and "\n" not in gone.stderr.strip()


def test_status_all_shows_every_gpus_broker_in_the_runtime_dir(short_tmp):
    from helpers import python_env

    env = {**python_env(), "KVCACHED_BROKER_RUNTIME_DIR": str(short_tmp)}
    brokers = [BrokerLauncher(None, device=i, simulate=f"{8 * (i + 1)}GiB", env=env) for i in (0, 1)]
    try:
        for b in brokers:
            b.start()  # no --endpoint: each binds its default socket in the runtime dir, and answers
        assert [b.endpoint for b in brokers] == [f"ipc://{short_tmp}/gpu{i}.sock" for i in (0, 1)]
        out = cli("status", "--all", "--json", env=env)
        assert out.returncode == 0, out.stderr
        docs = json.loads(out.stdout)
        assert [d["device"]["index"] for d in docs] == [0, 1]
        assert [d["total_bytes"] for d in docs] == [8 * GIB, 16 * GIB]
        table = cli("status", "--all", env=env)
        assert table.stdout.count("(simulated)") == 2
    finally:
        for b in brokers:
            b.stop()
