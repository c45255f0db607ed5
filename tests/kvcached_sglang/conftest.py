"""kvcached mode in SGLang: kvcached 0.1.6's real Python code and SGLang 0.5.23's real classes.

Run in the combined overlay ``kvcached+sglang-0.5.23`` (scripts/test-adapters.sh: SGLang's
overlay, the common packages, the test stubs and kvcached's Python code on one path); skipped
elsewhere.  Every SGLang rank is its own process (``sglang_rank.py``) on its own simulated GPU
with its own real broker; the ranks of a TP group share a gloo process group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import python_env, require_runtime

HERE = Path(__file__).resolve().parent
RANK = HERE / "sglang_rank.py"
#: One pool page of the ranks' model: 2 MiB x 4 layers x K and V.
POOL_PAGE_BYTES = 16 << 20
#: One broker session page.
SESSION_PAGE_BYTES = 2 << 20


@pytest.fixture(scope="session", autouse=True)
def overlay() -> str:
    """SGLang and kvcached at the overlay's versions (a missing one fails inside the overlay)."""
    found = require_runtime("sglang")
    expected = os.environ.get("KVCACHED_BROKER_TEST_KVCACHED", "")
    from importlib.metadata import PackageNotFoundError, version

    try:
        kvcached = version("kvcached")
    except PackageNotFoundError:
        kvcached = None
    if expected:
        assert kvcached == expected.split("-", 1)[1], f"overlay expects {expected}, found kvcached {kvcached}"
    elif kvcached is None:
        pytest.skip("kvcached mode for SGLang runs in the kvcached+sglang overlay (make test-adapters)")
    return found


@dataclass
class RankProcess:
    """One SGLang rank (``sglang_rank.py``), driven line by line."""

    proc: subprocess.Popen
    name: str
    ipc_name: str
    log: Path
    replies: list = field(default_factory=list)

    def request(self, op: str, **args) -> dict:
        self.send(op, **args)
        return self.receive()

    def send(self, op: str, **args) -> None:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"rank {self.name} exited with {self.proc.wait(timeout=30)}:\n{self.log_tail()}")
        reply = json.loads(line)
        assert "exception" not in reply, f"rank {self.name}: {reply['exception']}\n{reply.get('traceback', '')}"
        return reply

    def log_tail(self) -> str:
        return self.log.read_text()[-4000:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("exit")
                self.proc.wait(timeout=30)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=30)
        (Path("/dev/shm") / self.ipc_name).unlink(missing_ok=True)


@pytest.fixture
def ranks(short_tmp):
    """``start(endpoints, ...)``: one rank process per endpoint (a broker, or ``"off"``), each on
    its own simulated GPU, joined in one gloo group; they are ready when it returns."""
    started: list[RankProcess] = []

    def start(endpoints: list[str], *, total_bytes: int = 1 << 30, instance: str = "model-tp", weights: int = 0,
              direct: bool = False, batch: str = "64MiB") -> list[RankProcess]:
        init = short_tmp / f"pg-{uuid.uuid4().hex[:8]}"
        group = []
        for rank, endpoint in enumerate(endpoints):
            usage = short_tmp / f"gpu{rank}-{uuid.uuid4().hex[:6]}"
            ipc = f"kvb-sg-{uuid.uuid4().hex[:10]}"
            env = python_env()
            env.update(ENABLE_KVCACHED="1", KVCACHED_AUTOPATCH="1", KVCACHED_BROKER=endpoint, TRITON_INTERPRET="1",
                       KVCACHED_BROKER_INSTANCE=instance, KVCACHED_BROKER_KV_BATCH=batch, KVCACHED_LOG_LEVEL="WARNING")
            log = short_tmp / f"rank{rank}-{ipc}.log"
            args = [sys.executable, str(RANK), str(usage), str(total_bytes), ipc, "--rank", str(rank),
                    "--world", str(len(endpoints)), "--init", str(init), "--weights", str(weights)]
            proc = subprocess.Popen(args + (["--direct"] if direct else []), stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, env=env)
            group.append(RankProcess(proc, f"{instance}/{rank}", ipc, log))
        started.extend(group)
        for process in group:
            assert process.receive()["ready"]
        return group

    yield start
    for process in started:
        process.stop()


def on_all(group: list[RankProcess], op: str, **args) -> list[dict]:
    """Send ``op`` to every rank, then read every reply (collective ops need all ranks at once)."""
    for process in group:
        process.send(op, **args)
    return [process.receive() for process in group]


def session_pages(broker, instance: str) -> int:
    """Session pages the broker granted ``instance``'s sessions."""
    inst = next((i for i in broker.status()["instances"] if i["name"] == instance), None)
    return sum(s["granted_pages"] for s in inst["sessions"]) if inst else 0


@pytest.fixture
def gpu_broker(broker_factory):
    """``make(device, total)``: a broker of its own for one simulated GPU."""

    def make(device: int, total: str = "1GiB"):
        return broker_factory(simulate=total, device=device, extra_args=["--headroom", "0"])

    return make
