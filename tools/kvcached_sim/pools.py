"""Start and drive :mod:`.pool_process` processes: one real kvcached pool each, JSON lines.

Used by the kvcached tests (tests/adapters/kvcached/kv_harness.py), the hand-over benchmark
(benchmarks/handover.py) and ``kvcached-broker demo``.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ...client.protocol import DEFAULT_PAGE_BYTES as SESSION_PAGE_BYTES  # the adapters' session page
from .. import json_lines
from . import child_env

MODULE = "kvcached_broker.tools.kvcached_sim.pool_process"


def pool_page_bytes(layers: int) -> int:
    """One kvcached compound page of :mod:`.pool_process`'s model: 2 MiB x layers x K and V."""
    return SESSION_PAGE_BYTES * layers * 2


@dataclass
class PoolProcess:
    """A pool_process process: one kvcached pool, driven line by line."""

    proc: subprocess.Popen
    ipc_name: str
    instance: str
    ready: dict = field(default_factory=dict)

    @classmethod
    def start(cls, endpoint: str, usage: Path, total_bytes: int, instance: str, *, env: dict | None = None,
              stderr: Path | None = None, args: tuple[str, ...] = (), wait: bool = True,
              module: str = MODULE, ipc_name: str | None = None) -> "PoolProcess":
        """Start the process for ``instance`` on the shared GPU at ``usage``; ``endpoint`` is its broker
        (give ``KVCACHED_BROKER=off`` in ``env`` for kvcached alone).  ``wait``: read its ready line.
        ``module``: the program (the GPU check runs the same pool on a real GPU with its own).
        ``ipc_name``: its segment's name (``KVCACHED_IPC_NAME``; default: a new one)."""
        ipc_name = ipc_name or f"kvb-sim-{uuid.uuid4().hex[:10]}"
        env = child_env(env)
        env.update({"KVCACHED_BROKER_INSTANCE": instance, "KVCACHED_LOG_LEVEL": "WARNING"})
        err = open(stderr, "w") if stderr is not None else subprocess.DEVNULL
        proc = subprocess.Popen(
            [sys.executable, "-m", module, str(usage), str(total_bytes), ipc_name, endpoint, *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        pool = cls(proc, ipc_name, instance)
        if wait:
            pool.wait_ready()
        return pool

    def wait_ready(self) -> dict:
        if not self.ready:
            self.ready = self.receive()
        return self.ready

    def request(self, op: str, **args) -> dict:
        self.send(op, **args)
        return self.receive()

    def send(self, op: str, **args) -> None:
        """Send a request without waiting for its reply (:meth:`receive` reads it)."""
        json_lines.send(self.proc, op, **args)

    def receive(self) -> dict:
        answer = json_lines.receive(self.proc)
        if answer is None:
            raise AssertionError(f"pool process {self.instance} exited with {json_lines.exit_status(self.proc)}")
        return answer

    def pool(self) -> dict:
        return self.request("status")["pools"][0]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        json_lines.stop(self.proc)
        (Path("/dev/shm") / self.ipc_name).unlink(missing_ok=True)
        (Path("/dev/shm") / f"{self.ipc_name}.kvcached-broker").unlink(missing_ok=True)  # the governors' record
