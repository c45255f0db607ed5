"""Device probes: what the GPU says about its memory, from NVML or from a simulation.

A probe answers two questions: how big is the device, and who uses how much of it.  The
broker turns that into ``external_bytes`` (memory used by processes it does not know) and
per-process measured bytes (for ``charge = max(reported, measured)``).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Protocol

# Re-exported: the shared-usage files' writers (tools.shared_gpu) stamp their start with it.
from ..client.procfs import running_start_ticks
from .accounts import DeviceInfo

log = logging.getLogger(__name__)


@dataclass
class DeviceReading:
    """One reading.  ``used_bytes`` is None on a simulated device, where ``external_bytes``
    is given directly.  ``per_process`` says whether ``process_bytes`` can be trusted."""

    total_bytes: int
    used_bytes: int | None = None
    process_bytes: dict[int, int] = field(default_factory=dict)
    per_process: bool = True
    external_bytes: int | None = None

    def external_for(self, registered_pids: Iterable[int], reported_bytes: int) -> int:
        """Memory in use by processes that are not registered with the broker."""
        if self.external_bytes is not None:
            return self.external_bytes
        assert self.used_bytes is not None
        if self.per_process:
            pids = set(registered_pids)
            mine = sum(size for pid, size in self.process_bytes.items() if pid in pids)
            return max(0, self.used_bytes - mine)
        # No per-process figures (MIG, some containers): assume registered processes use what
        # they reported, so that their own usage is not counted twice as external.
        return max(0, self.used_bytes - reported_bytes)


class DeviceProbe(Protocol):
    info: DeviceInfo

    def read(self) -> DeviceReading: ...


class DeviceError(RuntimeError):
    """The device cannot be opened (no NVML, no such GPU)."""


class NoSuchProcess(ValueError):
    """Usage was set for a pid that does not run (a simulated device reports running processes only)."""


class SimulatedDevice:
    """A GPU of ``total_bytes`` that exists only in the broker, for machines without one.

    Tests and demos inject usage by others with :meth:`set_external` and per-process usage
    with :meth:`set_process_bytes` (reachable over the wire via the admin ``simulate`` op).

    Invariant, as NVML: a reading lists a process only while it runs.  Usage set for a pid is
    tied to that process's start time; once the pid no longer runs (exited, a zombie, or reused
    by a process that started later) its entry is dropped for good.

    With ``usage_dir`` the device is shared by processes, as a real GPU is: each process that
    "allocates" on it keeps a file ``usage_dir/PID`` holding the bytes it uses and its start
    time (``SIZE START_TICKS``, replaced atomically), and the device reports those files as
    each running process's usage, the way NVML reports what each process has mapped.  The
    processes read the same files to know what is free (their ``cudaMemGetInfo``).  See
    :func:`read_shared_usage` and ``tools/shared_gpu.py``.

    ``start_ticks(pid)`` says when a running pid started (None if it does not run); it is
    :func:`running_start_ticks` unless a test injects another.
    """

    def __init__(self, index: int, total_bytes: int, usage_dir: Path | None = None, *,
                 start_ticks: Callable[[int], int | None] | None = None):
        if total_bytes <= 0:
            raise DeviceError(f"simulated device size must be positive, got {total_bytes}")
        self.info = DeviceInfo(index=index, uuid=f"SIM-GPU-{index}", name=f"simulated GPU {index}", simulated=True)
        self.total_bytes = total_bytes
        self._external_bytes = 0
        self._process_bytes: dict[int, tuple[int, int]] = {}  # pid -> (bytes, its start ticks)
        self._start_ticks = start_ticks or running_start_ticks
        self.usage_dir = usage_dir
        self._lock = threading.Lock()

    def set_external(self, external_bytes: int) -> None:
        with self._lock:
            self._external_bytes = external_bytes

    def set_process_bytes(self, process_bytes: dict[int, int]) -> None:
        """Set what the device reports these processes using (0 clears one); others keep theirs.

        All or nothing: raises :class:`NoSuchProcess` naming the first pid given a size that
        does not run, and then changes nothing."""
        stamped: dict[int, tuple[int, int] | None] = {}
        for pid, size_bytes in process_bytes.items():
            if size_bytes <= 0:
                stamped[pid] = None
                continue
            start = self._start_ticks(pid)
            if start is None:
                raise NoSuchProcess(f"no running process {pid}: a simulated device, like NVML, reports running processes only")
            stamped[pid] = (size_bytes, start)
        with self._lock:
            for pid, entry in stamped.items():
                if entry is None:
                    self._process_bytes.pop(pid, None)
                else:
                    self._process_bytes[pid] = entry

    def read(self) -> DeviceReading:
        shared = read_shared_usage(self.usage_dir, self._start_ticks) if self.usage_dir is not None else {}
        with self._lock:
            processes = {**shared, **self._running_process_bytes()}
            # As NVML: what every process uses, plus what the injected outsiders use; the
            # broker takes external usage as what its own processes do not account for.
            return DeviceReading(
                total_bytes=self.total_bytes,
                used_bytes=sum(processes.values()) + self._external_bytes,
                process_bytes=processes,
            )

    def _running_process_bytes(self) -> dict[int, int]:
        """The set usage of processes still running; drops the others' entries (lock held)."""
        running: dict[int, int] = {}
        for pid, (size_bytes, start) in list(self._process_bytes.items()):
            if self._start_ticks(pid) == start:
                running[pid] = size_bytes
            else:
                del self._process_bytes[pid]
        return running


class NvmlDevice:
    """A physical GPU read through NVML (the ``pynvml`` module of ``nvidia-ml-py``)."""

    def __init__(self, index: int):
        try:
            import pynvml
        except ImportError as exc:
            raise DeviceError("NVML is not available (pip install nvidia-ml-py); use --simulate SIZE without a GPU") from exc
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            raise DeviceError(f"cannot initialise NVML ({exc}); use --simulate SIZE on a machine without a GPU") from exc
        if not 0 <= index < count:
            raise DeviceError(f"no GPU {index}: NVML sees {count} device(s)")
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        uuid = _text(pynvml.nvmlDeviceGetUUID(self._handle))
        name = _text(pynvml.nvmlDeviceGetName(self._handle))
        self.info = DeviceInfo(index=index, uuid=uuid, name=name, simulated=False)

    def read(self) -> DeviceReading:
        nvml = self._nvml
        memory = nvml.nvmlDeviceGetMemoryInfo(self._handle)
        process_bytes: dict[int, int] = {}
        per_process = True
        try:
            processes = list(nvml.nvmlDeviceGetComputeRunningProcesses(self._handle))
            try:
                processes += list(nvml.nvmlDeviceGetGraphicsRunningProcesses(self._handle))
            except nvml.NVMLError:
                pass
        except nvml.NVMLError as exc:
            log.debug("event=nvml_processes_unavailable error=%s", exc)
            processes, per_process = [], False
        for proc in processes:
            used = getattr(proc, "usedGpuMemory", None)
            if not proc.pid or used is None or used >= (1 << 62):  # NVML_VALUE_NOT_AVAILABLE
                per_process = False
                continue
            process_bytes[int(proc.pid)] = process_bytes.get(int(proc.pid), 0) + int(used)
        return DeviceReading(
            total_bytes=int(memory.total),
            used_bytes=int(memory.used),
            process_bytes=process_bytes,
            per_process=per_process,
        )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def format_shared_usage(size_bytes: int, start_ticks: int | None) -> str:
    """A usage file's text: ``SIZE START_TICKS`` (``SIZE`` alone when the start is unknown)."""
    return str(size_bytes) if start_ticks is None else f"{size_bytes} {start_ticks}"


def parse_shared_usage(text: str) -> tuple[int, int | None]:
    """``(bytes, start ticks or None)`` from a usage file's text; raises ValueError if malformed."""
    parts = text.split()
    if not parts:
        return 0, None
    if len(parts) > 2:
        raise ValueError(f"expected SIZE [START_TICKS], got {text!r}")
    size_bytes = int(parts[0])
    start_ticks = int(parts[1]) if len(parts) == 2 else None
    if size_bytes < 0:
        raise ValueError(f"negative usage {size_bytes}")
    return size_bytes, start_ticks


def read_shared_usage(usage_dir: Path, start_ticks: Callable[[int], int | None] = running_start_ticks) -> dict[int, int]:
    """``{pid: bytes}`` from a shared simulated device's usage files, for running processes
    only: a dead process's memory is freed with it, as the driver frees a real one's, and a
    file stamped with another start time than the pid's is a previous holder's of that pid.
    A file without a start time is taken for whichever process runs under its pid."""
    usage: dict[int, int] = {}
    try:
        names = os.listdir(usage_dir)
    except OSError:
        return usage
    for name in names:
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            size_bytes, stamp = parse_shared_usage((usage_dir / name).read_text())
        except (OSError, ValueError):
            continue
        if size_bytes <= 0:
            continue
        running = start_ticks(pid)
        if running is not None and stamp in (None, running):
            usage[pid] = size_bytes
    return usage
