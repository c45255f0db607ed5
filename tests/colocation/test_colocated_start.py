"""Four servers started at the same moment on one simulated 80 GiB GPU, as an operator co-locates them.

* ``dsv4``: SGLang 0.5.23 with a DeepSeek-V4 pool (its SWA, compressed, indexer and
  compressor-state pools reported per pool, held static);
* ``mha``: SGLang 0.5.23 with a static MHA pool;
* ``vllm``: vLLM 0.33.0 with a static KV buffer;
* ``kvcached``: SGLang 0.5.23 in kvcached mode (kvcached 0.1.6's real Python code), whose KV cache
  grows page by page as requests arrive.

Each runs in its own runtime's overlay with ``ENABLE_KVCACHED=1`` (the adapters patch the runtime
by the startup hook alone) and takes every byte of its start-up on the shared device as it goes
(``server.py``, ``sglang_rank.py``'s ``start_up``): a CUDA context, weights, the runtime's own
sizing, its pools, CUDA graphs, the warm-up's activations; then it serves, with a later prefill's
activations and (kvcached) KV pages as requests come.  The broker runs at its default headroom
(5%) and reads the device only at its own probe, as it reads NVML; the operator capped the three
static servers (``kvcached-broker limit``), so they fit whatever order they size in.

What must hold: every server serves or fails its start with one line naming the broker and the
room; none ever meets CUDA's out-of-memory error; at every sample, the device holds no more than
its total, and for every serving process what the broker charges it (resident reports and what
it was promised) covers what the device measures it using; and once all are up, nothing is
overcommitted and every process is charged at least what the device measures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers import GIB, MIB, BackgroundThread, device_and_status

pytest.importorskip("torch", reason="the servers build their runtimes' pools with torch (a CPU build in .venv)")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ENVS = ROOT / ".adapter-envs"
SERVER = HERE / "server.py"
RANK = HERE.parent / "adapters" / "sglang" / "sglang_rank.py"
TOTAL = 80 * GIB

#: role -> (instance, the operator's cap, what its start-up takes)
SERVERS = {
    "dsv4": ("dsv4-flash", 28 * GIB, {"weights_bytes": 14 * GIB, "mem_fraction_static": 0.88,
                                      "graphs_bytes": 1 * GIB, "warmup_bytes": 2 * GIB, "batch_bytes": 3 * GIB}),
    "mha": ("llama-8b", 18 * GIB, {"weights_bytes": 6 * GIB, "mem_fraction_static": 0.90,
                                   "graphs_bytes": 512 * MIB, "warmup_bytes": 1 * GIB, "batch_bytes": 2 * GIB}),
    "vllm": ("qwen-7b", 12 * GIB, {"weights_bytes": 6 * GIB, "gpu_memory_utilization": 0.3,
                                   "profile_peak_bytes": 2 * GIB, "graphs_bytes": 768 * MIB, "warmup_bytes": GIB,
                                   "batch_bytes": GIB}),
    "kvcached": ("llama-elastic", None, {"weights_bytes": 6 * GIB, "mem_fraction_static": 0.90,
                                         "graphs_bytes": 512 * MIB, "warmup_bytes": GIB, "batch_bytes": 2 * GIB}),
}


def _overlay(name: str) -> dict[str, str]:
    path = ENVS / f"{name}.env"
    if not path.exists():
        if os.environ.get("KVCACHED_BROKER_TEST_RUNTIME"):
            pytest.fail(f"{path} is missing: run `make adapter-envs`")
        pytest.skip(f"the {name} overlay is not built (make adapter-envs)")
    values = {}
    for line in path.read_text().splitlines():
        if line.startswith("export "):
            key, _, value = line[len("export "):].partition("=")
            values[key] = value.strip('"')
    return values


def _env(role: str, endpoint: str, instance: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_TARGET_DEVICE", "KVCACHED_IPC_NAME")}
    if role == "vllm":
        env.update(_overlay("vllm-0.33.0"))
    else:
        env.update(_overlay("sglang-0.5.23"))
    if role == "kvcached":
        env["PYTHONPATH"] = env["PYTHONPATH"] + ":" + _overlay("kvcached-0.1.6")["PYTHONPATH"]
        env.update(KVCACHED_AUTOPATCH="1", TRITON_INTERPRET="1", KVCACHED_LOG_LEVEL="WARNING")
    env.update(ENABLE_KVCACHED="1", KVCACHED_BROKER=endpoint, KVCACHED_BROKER_INSTANCE=instance)
    return env


@dataclass
class Server:
    role: str
    proc: subprocess.Popen
    log: Path
    pid: int = 0
    outcome: dict = field(default_factory=dict)

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def receive(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                reply = json.loads(line)
                assert "exception" not in reply, f"{self.role}: {reply['exception']}\n{reply.get('traceback')}"
                return reply
        raise AssertionError(f"{self.role} exited with {self.proc.wait(timeout=30)}:\n{self.log.read_text()[-4000:]}")

    def request(self, op: str, **args) -> dict:
        self.send(json.dumps({"op": op, **args}))
        return self.receive()


def _start(role: str, endpoint: str, usage_dir: Path, workdir: Path) -> Server:
    instance, _, spec = SERVERS[role]
    log = workdir / f"{role}.log"
    if role == "kvcached":
        argv = [str(RANK), str(usage_dir), str(TOTAL), "-", "--init", str(workdir / "pg-kvcached")]
    else:
        argv = [str(SERVER), role, str(usage_dir), str(TOTAL), json.dumps(spec)]
    proc = subprocess.Popen([sys.executable, *argv], env=_env(role, endpoint, instance), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)
    return Server(role, proc, log)


class Sampler(BackgroundThread):
    """Samples the device and the broker together (under the device's allocation lock) until
    stopped: the device's total, and the books of every serving process against its usage."""

    join_timeout_s = 60.0

    def __init__(self, broker, usage_dir: Path):
        self.broker, self.usage_dir = broker, usage_dir
        self.serving: set[int] = set()
        self.samples = 0
        self.violations: list[str] = []
        super().__init__()

    def _run(self) -> None:
        with self.broker.admin() as admin:
            while not self._stop.wait(0.02):
                self.sample(admin)

    def sample(self, admin) -> None:
        usage, status = device_and_status(self.usage_dir, admin)
        self.samples += 1
        if sum(usage.values()) > TOTAL:
            self.violations.append(f"the device holds {sum(usage.values())} bytes of {TOTAL}")
        books = _books_by_pid(status)
        for pid in list(self.serving):
            if usage.get(pid, 0) > books.get(pid, 0):
                self.violations.append(f"pid {pid} uses {usage.get(pid, 0)} bytes, its books cover {books.get(pid, 0)}")


def _serve_until_refused(server: Server, max_rounds: int = 400) -> dict:
    """Requests of 4 pool pages keep arriving at the elastic server (scheduler iterations in
    between, where its pool's limits change), until its broker refused to grow it: the room
    the others left is used, and past it requests wait (scheduling misses), none fails."""
    for _ in range(max_rounds):
        status = server.request("allocate", requests=4, tokens=4096)
        server.request("step", n=10)
        if status["pools"][0]["refusals"] >= 1:
            return status
    raise AssertionError(f"the elastic server's pool was never refused: {status}")


def _books_by_pid(status: dict) -> dict[int, int]:
    """What each process's sessions report resident (pools, mapped pages) plus what they were
    promised (holds, unmapped pages): every byte the process may have allocated with the broker's
    admission."""
    books: dict[int, int] = {}
    for instance in status["instances"]:
        for s in instance["sessions"]:
            pages = s["granted_pages"] * s["page_bytes"]
            books[s["pid"]] = books.get(s["pid"], 0) + s["reserved_bytes"] + pages
    return books


@pytest.mark.slow
def test_four_servers_started_together_never_overbook_and_each_serves_or_says_why(broker_factory, short_tmp):
    usage_dir = short_tmp / "gpu0"
    usage_dir.mkdir()
    broker = broker_factory(simulate="80GiB", extra_args=["--simulate-usage-dir", str(usage_dir)])
    with broker.admin() as admin:
        for instance, cap, _ in SERVERS.values():
            if cap is not None:
                admin.limit(instance, max_bytes=cap)
    servers = {role: _start(role, broker.endpoint, usage_dir, short_tmp) for role in SERVERS}
    try:
        for server in servers.values():
            ready = server.receive()
            server.pid = ready["pid"]
        with Sampler(broker, usage_dir) as sampler:
            for role, server in servers.items():  # the moment: all four start at once
                if role == "kvcached":
                    spec = SERVERS[role][2]
                    server.send(json.dumps({"op": "start_up", **{k: spec[k] for k in (
                        "weights_bytes", "mem_fraction_static", "graphs_bytes", "warmup_bytes")}}))
                else:
                    server.send("go")
            for server in servers.values():
                server.outcome = server.receive()
                if server.outcome["event"] == "serving":
                    sampler.serving.add(server.pid)
            serving = [s for s in servers.values() if s.outcome["event"] == "serving"]
            for server in serving:  # they serve: later prefills, and the elastic server's requests
                if server.role == "kvcached":
                    served = _serve_until_refused(server)
                    assert served["errors"] == [] and served["running"] >= 8, served
                    outcome = server.request("batch", activations_bytes=SERVERS["kvcached"][2]["batch_bytes"])
                else:
                    server.send("batch")
                    outcome = server.receive()
                assert outcome["event"] == "batched", (server.role, outcome)
            with broker.admin() as admin:
                sampler.sample(admin)
        usage, status = device_and_status(usage_dir, broker.admin())
    finally:
        for server in servers.values():
            if server.proc.poll() is None:
                try:
                    server.send(json.dumps({"op": "exit"}) if server.role == "kvcached" else "")
                    server.proc.stdin.close()
                except (BrokenPipeError, OSError):
                    pass
        for server in servers.values():
            try:
                server.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.proc.kill()
    outcomes = {s.role: s.outcome for s in servers.values()}
    assert not any(o["event"] == "crashed" for o in outcomes.values()), outcomes
    for role, outcome in outcomes.items():
        if outcome["event"] == "refused":
            error = outcome["error"]
            assert broker.endpoint in error and "\n" not in error and "free" in error, (role, error)
        else:
            assert outcome["event"] == "serving", (role, outcome)
    assert sampler.samples >= 10 and sampler.violations == [], sampler.violations[:5]
    assert not status["overcommitted"] and sum(usage.values()) <= TOTAL
    by_pid = {s["pid"]: i for i in status["instances"] for s in i["sessions"]}
    for server in servers.values():
        if server.outcome["event"] == "serving":
            assert by_pid[server.pid]["charged_bytes"] >= usage[server.pid], server.role
    assert sum(s.outcome["event"] == "serving" for s in servers.values()) == 4, outcomes
