"""What the kvcached-mode tests drive and check: pool processes, a sampler, kvctl.

:class:`PoolProcess` is a pool process (one real kvcached pool, from
``kvcached_broker.tools.kvcached_sim``, which ``make demo`` and the hand-over benchmark share);
:class:`Sampler` checks, at every sample, what each process has mapped against what the broker granted it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import GIB, MIB, BackgroundThread, device_and_status, granted_bytes_by_pid, python_env  # noqa: F401

from kvcached_broker.client import BrokerUnavailable
from kvcached_broker.tools.kvcached_sim.pools import PoolProcess as SimPool

#: One pool page of the workers' model: 2 MiB x 4 layers x K and V.
POOL_PAGE_BYTES = (2 << 20) * 4 * 2


class PoolProcess(SimPool):
    """A pool process (kvcached_broker.tools.kvcached_sim.pool_process): one kvcached pool."""

    @classmethod
    def start(cls, broker, usage: Path, total_bytes: int, instance: str, extra_env: dict | None = None,
              wait: bool = True, ipc_name: str | None = None) -> "PoolProcess":
        env = python_env()
        for flag in ("ENABLE_KVCACHED", "KVCACHED_AUTOPATCH", "KVCACHED_REQUIRE"):
            env.pop(flag, None)  # the patch is applied explicitly unless a test asks for the .pth hook
        env.update(extra_env or {})
        return super().start(broker.endpoint, usage, total_bytes, instance, env=env,
                             stderr=usage.parent / f"{instance}.err", wait=wait, ipc_name=ipc_name)


class Sampler(BackgroundThread):
    """Samples, with the shared GPU's allocation lock held (so no process maps or unmaps
    meanwhile), every process's bytes on the device and the broker's status, and checks at
    every sample: each process's KV pages mapped (its bytes minus its pool's zero page, which
    kvcached allocates with the KV tensors) <= the pages the broker granted its sessions, and
    the sum of every process's bytes <= the budget."""

    def __init__(self, broker, usage: Path):
        self.broker = broker
        self.usage = usage
        self.samples = 0
        self.skipped = 0  # the broker was down
        self.violations: list[str] = []
        self.peak_mapped: dict[int, int] = {}
        super().__init__()
        usage.mkdir(parents=True, exist_ok=True)

    def _run(self) -> None:
        admin = None
        while not self._stop.is_set():
            try:
                if admin is None:
                    admin = self.broker.admin(timeout_s=1.0)
                self.sample(admin)
            except BrokerUnavailable:
                self.skipped += 1
                if admin is not None:
                    admin.close()
                admin = None
            self._stop.wait(0.005)
        if admin is not None:
            admin.close()

    def sample(self, admin) -> None:
        usage, status = device_and_status(self.usage, admin)
        self.samples += 1
        granted = granted_bytes_by_pid(status)
        for pid, used in usage.items():
            mapped = used - POOL_PAGE_BYTES  # every worker has one pool, with one zero page
            self.peak_mapped[pid] = max(self.peak_mapped.get(pid, 0), mapped)
            if pid in granted and mapped > granted[pid]:
                self.violations.append(f"pid {pid}: {mapped} bytes of KV pages mapped, {granted[pid]} granted")
        if sum(usage.values()) > status["budget_bytes"]:
            self.violations.append(f"{sum(usage.values())} bytes on the device, budget {status['budget_bytes']}")

    def check(self, min_samples: int = 20) -> None:
        assert not self.violations, self.violations[:5]
        assert self.samples >= min_samples, f"only {self.samples} samples"


def kvctl(*args: str) -> subprocess.CompletedProcess:
    """kvcached's own kvctl, as an operator runs it."""
    return subprocess.run([sys.executable, "-m", "kvcached.cli.kvctl", *args], capture_output=True, text=True,
                          timeout=60, env=python_env())


def session_of(status: dict, instance: str) -> dict:
    (inst,) = [i for i in status["instances"] if i["name"] == instance]
    (session,) = inst["sessions"]
    return session
