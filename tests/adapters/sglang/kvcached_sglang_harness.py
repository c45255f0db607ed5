"""kvcached mode in SGLang: kvcached 0.1.6's real Python code and SGLang 0.5.23's real classes.

The harness of the ``test_kvcached_sglang_*`` modules, which import its fixtures (``overlay``,
autouse, with them): they live beside SGLang's other adapter tests, and which overlay they run in
is their ``runtime("kvcached", "sglang")`` marker.

Run in the combined overlay ``kvcached+sglang-0.5.23`` (scripts/test-adapters.sh: SGLang's
overlay, the common packages, the test stubs and kvcached's Python code on one path); skipped
elsewhere.  Every SGLang rank is its own process (``sglang_rank.py``) on its own simulated GPU
with its own real broker; the ranks of a TP group share a gloo process group and, as an SGLang
server's ranks do, one process group (so one kvcached ``/dev/shm`` segment: kvcached names it
after the process group when ``KVCACHED_IPC_NAME`` is unset).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import BackgroundThread, device_and_status, granted_bytes_by_pid, python_env, require_kvcached_mode

from kvcached_broker.adapters.kvcached import segment
from kvcached_broker.client.protocol import DEFAULT_PAGE_BYTES

HERE = Path(__file__).resolve().parent
RANK = HERE / "sglang_rank.py"
#: One pool page of the ranks' model: 2 MiB x 4 layers x K and V.
POOL_PAGE_BYTES = 16 << 20
#: One broker session page (the client's default).
SESSION_PAGE_BYTES = DEFAULT_PAGE_BYTES


@pytest.fixture(scope="session", autouse=True)
def overlay() -> str:
    """SGLang and kvcached at the overlay's versions (a missing one fails inside the overlay)."""
    return require_kvcached_mode("sglang", "SGLang")


@dataclass
class RankProcess:
    """One SGLang rank (``sglang_rank.py``), driven line by line."""

    proc: subprocess.Popen
    name: str
    log: Path
    usage: Path  # its simulated GPU's usage directory
    ipc_name: str = ""  # the segment kvcached named (from the rank's ready line)
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
        if self.ipc_name:
            for path in (segment.path_of(self.ipc_name), segment.sidecar_path(self.ipc_name)):
                Path(path).unlink(missing_ok=True)


@pytest.fixture
def ranks(short_tmp):
    """``start(endpoints, ...)``: one rank process per endpoint (a broker, or ``"off"``), each on
    its own simulated GPU, joined in one gloo group and in one process group (rank 0 leads it),
    with kvcached's default IPC name: the ranks share one segment, as an SGLang server's do.
    They are ready when it returns."""
    started: list[RankProcess] = []

    def start(endpoints: list[str], *, total_bytes: int = 1 << 30, instance: str = "model-tp", weights: int = 0,
              direct: bool = False, batch: str = "64MiB") -> list[RankProcess]:
        init = short_tmp / f"pg-{uuid.uuid4().hex[:8]}"
        group = []
        for rank, endpoint in enumerate(endpoints):
            usage = short_tmp / f"gpu{rank}-{uuid.uuid4().hex[:6]}"
            env = python_env()
            env.pop("KVCACHED_IPC_NAME", None)
            env.update(ENABLE_KVCACHED="1", KVCACHED_AUTOPATCH="1", KVCACHED_BROKER=endpoint, TRITON_INTERPRET="1",
                       KVCACHED_BROKER_INSTANCE=instance, KVCACHED_BROKER_KV_BATCH=batch, KVCACHED_LOG_LEVEL="WARNING")
            log = short_tmp / f"rank{rank}-{uuid.uuid4().hex[:6]}.log"
            args = [sys.executable, str(RANK), str(usage), str(total_bytes), "-", "--rank", str(rank),
                    "--world", str(len(endpoints)), "--init", str(init), "--weights", str(weights)]
            leader = group[0].proc.pid if group else 0  # one process group, as SGLang's launcher gives
            proc = subprocess.Popen(args + (["--direct"] if direct else []), stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, env=env,
                                    process_group=leader)
            group.append(RankProcess(proc, f"{instance}/{rank}", log, usage))
        started.extend(group)
        for process in group:
            ready = process.receive()
            assert ready["ready"]
            process.ipc_name = ready["ipc_name"]
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
        return broker_factory(simulate=total, device=device, extra_args=["--headroom", "5%"])  # the default

    return make


class Sampler(BackgroundThread):
    """Checks, at every sample, every governed rank's bound: what the rank's process has mapped
    on its simulated GPU (its bytes less its pool's zero page, which kvcached allocates with the
    KV tensors) is at most what its GPU's broker granted the process's sessions.  Each GPU is
    read with its allocation lock held (nothing maps or unmaps meanwhile) while the broker's
    status is taken, as tests/adapters/kvcached and kvcached mode's vLLM tests sample theirs."""

    def __init__(self, ranks: list[tuple[RankProcess, object]], zero_page_bytes: int = POOL_PAGE_BYTES):
        self.ranks = ranks  # (rank, its GPU's broker)
        self.zero_page_bytes = zero_page_bytes
        self.samples = 0
        self.violations: list[str] = []
        self.peak_mapped: dict[str, int] = {}
        self._taken = threading.Condition()
        super().__init__()

    def _run(self) -> None:
        admins = {}
        try:
            while not self._stop.is_set():
                for rank, broker in self.ranks:
                    if rank.name not in admins:
                        admins[rank.name] = broker.admin(timeout_s=5.0)
                    self.sample(rank, admins[rank.name])
                with self._taken:
                    self.samples += 1
                    self._taken.notify_all()
                self._stop.wait(0.005)
        except Exception as exc:  # noqa: BLE001 - a sampler that cannot sample fails the test
            self.violations.append(f"sampler failed: {exc!r}")
        finally:
            for admin in admins.values():
                admin.close()

    def sample(self, rank: RankProcess, admin) -> None:
        usage, status = device_and_status(rank.usage, admin)
        used = usage.get(rank.proc.pid, 0)
        granted = granted_bytes_by_pid(status).get(rank.proc.pid, 0)
        mapped = max(0, used - self.zero_page_bytes)
        self.peak_mapped[rank.name] = max(self.peak_mapped.get(rank.name, 0), mapped)
        if mapped > granted:
            self.violations.append(f"{rank.name}: {mapped} bytes of KV pages mapped, {granted} granted")

    def observe(self, rounds: int = 3, timeout_s: float = 60.0) -> None:
        """Wait until ``rounds`` more full rounds (every rank) were sampled."""
        with self._taken:
            target = self.samples + rounds
            assert self._taken.wait_for(lambda: self.samples >= target or self.violations, timeout=timeout_s), \
                f"the sampler took no sample in {timeout_s}s"

    def check(self, min_samples: int = 20) -> None:
        assert not self.violations, self.violations[:5]
        assert self.samples >= min_samples, f"only {self.samples} samples"


@pytest.fixture
def sampler():
    """``sampler([(rank, broker), ...])``: a :class:`Sampler` over governed ranks (a context manager)."""
    return Sampler
