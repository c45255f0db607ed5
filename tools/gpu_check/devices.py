"""The device a GPU check runs on: a real GPU read through NVML, or the simulated device.

Every part is written once, against :class:`Device`: on a GPU the broker reads NVML and the
workers allocate through torch; with ``--simulate`` the broker runs ``serve --simulate`` on a
device that processes share (``--simulate-usage-dir``, :mod:`kvcached_broker.tools.shared_gpu`)
and the workers allocate on it.  So the simulated run goes through the same steps, and its
figures are what the simulation assumes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import ContextManager, Sequence

from ...broker.config import ServeConfig
from ...broker.device import DeviceProbe, DeviceReading, NvmlDevice, SimulatedDevice
from ..launch import BrokerLauncher
from ..shared_gpu import allocation_lock

GIB = 1 << 30
MIB = 1 << 20
#: The simulated device's size: an 80 GiB GPU, as the hand-over benchmark simulates.
SIMULATED_TOTAL_BYTES = 80 * GIB
#: How often the broker reads the device (``serve``'s default): the longest the simulation
#: lets a broker's view of a process trail what the process has.
PROBE_INTERVAL_S: float = ServeConfig(endpoint="").probe_interval_s
MODES = ("gpu", "simulate")


@dataclass(frozen=True)
class Device:
    """GPU 0 (``mode="gpu"``) or a shared simulated device under ``workdir`` (``"simulate"``)."""

    mode: str
    workdir: Path

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")

    @property
    def simulated(self) -> bool:
        return self.mode == "simulate"

    @property
    def usage_dir(self) -> Path:
        """Where the simulated device's processes write their usage (unused on a GPU)."""
        return self.workdir / "gpu-usage"

    def probe(self) -> DeviceProbe:
        """What the broker reads: NVML, or the simulated device's usage files."""
        if self.simulated:
            self.usage_dir.mkdir(parents=True, exist_ok=True)
            return SimulatedDevice(0, SIMULATED_TOTAL_BYTES, self.usage_dir)
        return NvmlDevice(0)

    def total_bytes(self) -> int:
        return SIMULATED_TOTAL_BYTES if self.simulated else self.probe().read().total_bytes

    def broker(self, name: str, args: Sequence[str] = ()) -> BrokerLauncher:
        """A broker for this device (not started), its log in ``workdir/NAME.log``."""
        common = ["--log-level", "info", *args]
        endpoint = f"ipc://{self.workdir}/{name}.sock"
        state = self.workdir / f"{name}-state"
        log = self.workdir / f"{name}.log"
        if self.simulated:
            self.usage_dir.mkdir(parents=True, exist_ok=True)
            return BrokerLauncher(endpoint, simulate=f"{SIMULATED_TOTAL_BYTES}B", state_dir=state, log=log,
                                  args=["--simulate-usage-dir", str(self.usage_dir), *common])
        return BrokerLauncher(endpoint, simulate=None, state_dir=state, log=log, device=0, args=common)

    def worker_args(self) -> list[str]:
        """How :mod:`.worker` is told which device it allocates on."""
        if self.simulated:
            return ["simulate", str(self.usage_dir), str(SIMULATED_TOTAL_BYTES)]
        return ["gpu"]

    def quiesced(self) -> ContextManager[None]:
        """While held, no process allocates or frees on a simulated device (its allocation lock);
        a GPU has no such lock, so readings there are bracketed instead (see the pools part)."""
        if self.simulated:
            return allocation_lock(self.usage_dir)
        return contextlib.nullcontext()


def process_bytes(reading: DeviceReading, pid: int) -> int:
    """What the reading says ``pid`` uses (0 when it is not listed)."""
    return reading.process_bytes.get(pid, 0)

