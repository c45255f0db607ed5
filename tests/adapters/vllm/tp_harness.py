"""What the kvcached+vLLM tests start and check: engine and worker processes, and a sampler.

:class:`Processes` starts ``tp_engine.py`` (vLLM's EngineCore in kvcached mode) and
``tp_worker.py`` (a TP worker) processes that share one kvcached instance name (so one TP socket
directory and one board).  :class:`Sampler` checks, at every sample, the bounds kvcached mode
promises for a broadcast-mode pool:

* on every GPU, under the simulated device's allocation lock (nobody maps meanwhile), what each
  worker process has mapped (its bytes less its pool's zero page) is at most what its broker
  session was granted, and the device is within its budget;
* on the board, read at one instant, EngineCore's limit is at most every governed worker's
  grant, and each governed worker maps at most its grant.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import kv_model
from helpers import BackgroundThread, device_and_status, granted_bytes_by_pid, python_env

from kvcached_broker.adapters.kvcached.broadcast import board as board_mod
from kvcached_broker.client import BrokerUnavailable
from kvcached_broker.client.admin import AdminClient
from kvcached_broker.tools.launch import BrokerLauncher

HERE = Path(__file__).resolve().parent
GIB = 1 << 30
#: one pool page of the test model (2 MiB per layer, and per K and V buffer on kvcached's V1 layout)
POOL_PAGE_BYTES = kv_model.pool_page_bytes()
BLOCKS_PER_PAGE = kv_model.blocks_per_page()
#: the pools' growth batch (``KVCACHED_BROKER_KV_BATCH``): 8 pool pages
KV_BATCH_BYTES = 64 << 20


class Broker:
    """A broker process for one simulated GPU shared by processes (at its default headroom, 5%), in ``workdir``."""

    def __init__(self, workdir: Path, total: str, usage: Path):
        self.endpoint = f"ipc://{workdir}/gpu0.sock"
        self.launcher = BrokerLauncher(self.endpoint, simulate=total, state_dir=workdir / "state",
                                       args=["--lease", "10", "--headroom", "5%", "--simulate-usage-dir", str(usage)],
                                       log=workdir / "broker.log")

    def start(self) -> "Broker":
        self.launcher.start(wait=True)
        return self

    def admin(self, timeout_s: float = 5.0) -> AdminClient:
        return AdminClient(self.endpoint, timeout_s=timeout_s)

    def status(self) -> dict:
        with self.admin() as admin:
            return admin.status()

    def stop(self) -> None:
        import signal

        self.launcher.stop(signal.SIGTERM)


@dataclass
class Gpu:
    """One simulated GPU and its broker."""

    broker: Broker
    usage: Path
    root: Path

    @property
    def endpoint(self) -> str:
        return self.broker.endpoint


class Process:
    """A driver process answering one JSON line per request line."""

    def __init__(self, proc: subprocess.Popen, name: str, wait: bool = True):
        self.proc = proc
        self.name = name
        self.ready = self.receive() if wait else None

    def wait_ready(self) -> dict:
        """The ready line of a process started with ``wait=False``."""
        if self.ready is None:
            self.ready = self.receive()
        return self.ready

    def request(self, op: str, **args) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self.receive()

    def receive(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"{self.name} exited with {self.proc.wait(timeout=30)}")
        return json.loads(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.request("exit")
            except (AssertionError, BrokenPipeError, OSError, ValueError):
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


class Processes:
    """The processes of one vLLM instance in kvcached mode (one kvcached IPC name)."""

    def __init__(self, root: Path):
        self.root = root
        self.ipc_name = f"kvb-tp-{uuid.uuid4().hex[:8]}"
        self.started: list[Process] = []
        self._stops: list = []

    def on_stop(self, stop) -> None:
        """Also call ``stop()`` when the processes stop (another process the test started)."""
        self._stops.append(stop)

    def env(self, endpoint: str | None, **extra: str) -> dict[str, str]:
        env = python_env()
        env.update({
            "ENABLE_KVCACHED": "1", "KVCACHED_AUTOPATCH": "1", "KVCACHED_IPC_NAME": self.ipc_name,
            "KVCACHED_BROKER_INSTANCE": "vllm-tp", "KVCACHED_LOG_LEVEL": "WARNING", "VLLM_LOGGING_LEVEL": "ERROR",
            "KVCACHED_MAX_CACHED_TOKENS": "-1", "KVCACHED_BROKER_KV_BATCH": f"{KV_BATCH_BYTES >> 20}MiB", "VLLM_TARGET_DEVICE": "cpu",
        })
        if endpoint is None:
            env["KVCACHED_BROKER"] = "off"
        else:
            env["KVCACHED_BROKER"] = endpoint
        env.update(extra)
        return env

    def _start(self, name: str, args: list[str], env: dict[str, str], wait: bool = True) -> Process:
        err = open(self.root / f"{name}.err", "w")
        proc = subprocess.Popen([sys.executable, str(HERE / args[0]), *args[1:]], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        process = Process(proc, name, wait)
        self.started.append(process)
        return process

    def worker(self, gpu: Gpu, rank: int, world_size: int, total_bytes: int = GIB, **env: str) -> Process:
        return self._start(f"worker{rank}", ["tp_worker.py", str(gpu.usage), str(total_bytes), str(rank),
                                             str(world_size)], self.env(gpu.endpoint, **env))

    def unreachable_worker(self, usage: Path, rank: int, world_size: int, total_bytes: int = GIB) -> Process:
        env = self.env(f"ipc://{self.root}/nobody.sock", KVCACHED_BROKER_TIMEOUT_S="1")
        return self._start(f"worker{rank}", ["tp_worker.py", str(usage), str(total_bytes), str(rank),
                                             str(world_size)], env)

    def engine(self, world_size: int, gpu: Gpu | None = None, wait: bool = True, **env: str) -> Process:
        """EngineCore; with TP workers elsewhere it maps nothing (its "device" only answers
        cudaMemGetInfo); with ``world_size`` 1 its worker is in-process, on ``gpu``.  With ``wait``
        False it returns at once (``wait_ready()`` later: it is ready once its pool's null block is
        mapped on every worker)."""
        if gpu is None:
            usage, total, endpoint = self.root / "engine-usage", 64 * GIB, None
        else:
            usage, total, endpoint = gpu.usage, GIB, gpu.endpoint
        return self._start("engine", ["tp_engine.py", str(usage), str(total), str(world_size)],
                           self.env(endpoint, **env), wait)

    def stderr(self, name: str) -> str:
        path = self.root / f"{name}.err"
        return path.read_text() if path.exists() else ""

    def board_path(self, group_id: int = 0) -> str:
        from kvcached.utils import get_tp_socket_dir

        return board_mod.board_path(group_id, get_tp_socket_dir(self.ipc_name))

    def board(self) -> board_mod.Board:
        """The board, mapped here as a reader (made if absent; this process writes no record, so
        the engine's and workers' leaving removes it as usual)."""
        return board_mod.Board(self.board_path())

    def stop_all(self) -> None:
        for stop in reversed(self._stops):
            stop()
        for process in reversed(self.started):
            process.stop()


class Sampler(BackgroundThread):
    """Checks every GPU and the board at every sample, until stopped (see the module docstring)."""

    def __init__(self, gpus: list[Gpu], board: board_mod.Board, slots: int, *, zero_page_bytes: int = POOL_PAGE_BYTES):
        self.gpus = gpus
        self.board = board
        self.slots = slots
        self.zero_page_bytes = zero_page_bytes
        self._zero_pages: dict[int, int] = {}  # pid -> its pool's zero page, where not the test model's
        self.samples = 0
        self.board_samples = 0
        self.unsteady = 0  # board reads that never stood still
        self.ungoverned = 0  # board reads before a governing engine
        self.violations: list[str] = []
        self.peak_mapped: dict[int, int] = {}
        self.peak_limit_pages = 0
        self._taken = threading.Condition()
        super().__init__()

    def zero_page(self, pid: int, size_bytes: int) -> None:
        """Process ``pid``'s pool keeps a zero page of ``size_bytes`` (a pool of another geometry
        than the test model's, such as a neighbour's): set before it allocates anything."""
        self._zero_pages[pid] = size_bytes

    def observe(self, rounds: int = 3, timeout_s: float = 60.0) -> None:
        """Wait until ``rounds`` more full rounds (every GPU and the governing board) were sampled."""
        with self._taken:
            target = self.board_samples + rounds
            assert self._taken.wait_for(lambda: self.board_samples >= target, timeout=timeout_s), \
                f"the sampler took no board sample in {timeout_s}s ({self.ungoverned} before a governing engine)"

    def _run(self) -> None:
        admins: dict[int, object] = {}
        while not self._stop.is_set():
            for index, gpu in enumerate(self.gpus):
                try:
                    if index not in admins:
                        admins[index] = gpu.broker.admin(timeout_s=2.0)
                    self.sample_gpu(gpu, admins[index])
                except BrokerUnavailable:
                    admins.pop(index).close()
            self.sample_board()
            with self._taken:
                self._taken.notify_all()
            self._stop.wait(0.005)
        for admin in admins.values():
            admin.close()

    def sample_gpu(self, gpu: Gpu, admin) -> None:
        usage, status = device_and_status(gpu.usage, admin)
        self.samples += 1
        granted = granted_bytes_by_pid(status)
        for pid, used in usage.items():
            mapped = used - self._zero_pages.get(pid, self.zero_page_bytes)
            self.peak_mapped[pid] = max(self.peak_mapped.get(pid, 0), mapped)
            if pid in granted and mapped > granted[pid]:
                self.violations.append(f"pid {pid}: {mapped} bytes of KV pages mapped, {granted[pid]} granted")
        if sum(usage.values()) > status["budget_bytes"]:
            self.violations.append(f"{sum(usage.values())} bytes on the device, budget {status['budget_bytes']}")

    def sample_board(self) -> None:
        snapshot = self.board.snapshot(self.slots, attempts=100)
        if snapshot is None:
            self.unsteady += 1
            return
        engine, slots = snapshot
        if engine.state != board_mod.ENGINE_GOVERNING:
            self.ungoverned += 1
            return
        self.board_samples += 1
        self.peak_limit_pages = max(self.peak_limit_pages, engine.limit_pages)
        governed = [s for s in slots if s.state == board_mod.SLOT_GOVERNED]
        for index, slot in enumerate(slots):
            if slot.state == board_mod.SLOT_GOVERNED and slot.mapped_pages > slot.granted_pages:
                self.violations.append(f"slot {index}: {slot.mapped_pages} pages mapped, {slot.granted_pages} granted")
        if governed and engine.limit_pages > min(s.granted_pages for s in governed):
            self.violations.append(f"engine limit {engine.limit_pages} pages above a worker's grant "
                                   f"{[s.granted_pages for s in governed]}")

    def check(self, min_samples: int = 3) -> None:
        assert not self.violations, self.violations[:5]
        assert self.samples >= min_samples and self.board_samples >= min_samples, (
            self.samples, self.board_samples, self.unsteady, self.ungoverned)
