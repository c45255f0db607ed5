"""The process side of a simulated GPU shared by processes (``serve --simulate-usage-dir DIR``).

A process that "allocates" device memory records the bytes it now uses in ``DIR/PID``, with
its start time (``SIZE START_TICKS``), so that a later process given the same pid is not taken
for it; the broker reports those files as each running process's usage, as NVML does, and
every process reads them to know what is free, as ``cudaMemGetInfo`` tells it.  So a
neighbour's allocation shrinks everyone's free memory, and an allocation that does not fit
fails, as on a GPU.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from ..broker.device import format_shared_usage, parse_shared_usage, read_shared_usage
from ..client.procfs import running_start_ticks


class DeviceFull(RuntimeError):
    """The shared device has no room for the allocation (``cuMemCreate`` out of memory)."""


class SharedGpu:
    """Process ``pid``'s view of the shared device (this process unless told otherwise).

    Invariant: the usage file ``DIR/PID`` it writes is stamped with ``pid``'s start time, and
    only a file with that stamp (or none) counts as this process's usage."""

    def __init__(self, usage_dir: Path, total_bytes: int, *, pid: int | None = None):
        self.usage_dir = Path(usage_dir)
        self.total_bytes = total_bytes
        self.pid = os.getpid() if pid is None else pid
        self.start_ticks = running_start_ticks(self.pid)
        self.usage_dir.mkdir(parents=True, exist_ok=True)

    def used_bytes(self) -> int:
        return sum(read_shared_usage(self.usage_dir).values())

    def free_bytes(self) -> int:
        """What ``cudaMemGetInfo`` would say is free."""
        return max(0, self.total_bytes - self.used_bytes())

    def mine_bytes(self) -> int:
        """What this process uses; 0 if its file is missing, malformed or a previous holder's of its pid."""
        try:
            size_bytes, stamp = parse_shared_usage((self.usage_dir / str(self.pid)).read_text())
        except (OSError, ValueError):
            return 0
        return size_bytes if stamp in (None, self.start_ticks) else 0

    def allocate(self, size_bytes: int) -> None:
        """Take ``size_bytes`` more; raises :class:`DeviceFull` if the device has no room."""
        with self._locked():
            if size_bytes > self.free_bytes():
                raise DeviceFull(f"out of memory: {size_bytes} bytes asked, {self.free_bytes()} free")
            self._write(self.mine_bytes() + size_bytes)

    def free(self, size_bytes: int) -> None:
        with self._locked():
            self._write(max(0, self.mine_bytes() - size_bytes))

    def set_usage(self, size_bytes: int) -> None:
        """Say this process uses exactly ``size_bytes`` (weights loaded, say)."""
        with self._locked():
            self._write(size_bytes)

    def _write(self, size_bytes: int) -> None:
        path = self.usage_dir / str(self.pid)
        tmp = self.usage_dir / f".{self.pid}.tmp"
        tmp.write_text(format_shared_usage(size_bytes, self.start_ticks))
        os.replace(tmp, path)

    def _locked(self):
        return allocation_lock(self.usage_dir)


def allocation_lock(usage_dir: Path) -> "_Flock":
    """The shared device's allocation lock (a context manager): while it is held no process
    allocates or frees, so a reader can compare what the device holds with the broker's view."""
    return _Flock(Path(usage_dir) / ".lock")


class _Flock:
    """One allocation at a time across processes, so two cannot both take the last bytes."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = -1

    def __enter__(self) -> None:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


#: What a serving process puts on a GPU before it allocates anything of its own, as the
#: simulated device models it (bytes).  A CUDA context (with cuBLAS's workspace) per process per
#: GPU it touches, the first segment torch's caching allocator reserves, and NCCL's buffers for
#: each communicator a tensor-parallel process opens.  Public figures for an H100 with CUDA 12;
#: the GPU check (``scripts/gpu-check``) measures them on the hardware (docs/performance.md).
CUDA_CONTEXT_BYTES = 512 << 20
TORCH_FIRST_SEGMENT_BYTES = 20 << 20
NCCL_COMMUNICATOR_BYTES = 320 << 20


class Footprint:
    """What one serving process holds on a shared simulated GPU, by what it is for.

    A server's start-up lands here in the order a real one allocates: its CUDA context when it
    first touches the GPU (:meth:`touch`), its weights, NCCL's buffers, the activation peak of a
    profiling pass (freed after: :meth:`peak`), its KV pools, its CUDA graphs, and the
    activations a warm-up and later batches leave in torch's cache.  An allocation that does
    not fit raises :class:`DeviceFull`, as CUDA's out-of-memory error does; nothing is taken
    then.  ``parts`` says how much each purpose holds (bytes)."""

    def __init__(self, gpu: SharedGpu):
        self.gpu = gpu
        self.parts: dict[str, int] = {}

    def touch(self, communicators: int = 0) -> None:
        """The process starts using the GPU: its context, torch's first segment, and NCCL's
        buffers for ``communicators`` communicators (tensor parallelism)."""
        self.allocate("cuda_context", CUDA_CONTEXT_BYTES)
        self.allocate("torch_cache", TORCH_FIRST_SEGMENT_BYTES)
        if communicators:
            self.allocate("nccl", communicators * NCCL_COMMUNICATOR_BYTES)

    def allocate(self, part: str, size_bytes: int) -> None:
        if size_bytes <= 0:
            return
        try:
            self.gpu.allocate(size_bytes)
        except DeviceFull as exc:
            raise DeviceFull(f"CUDA error: out of memory allocating {size_bytes} bytes for {part} ({exc})") from None
        self.parts[part] = self.parts.get(part, 0) + size_bytes

    def free(self, part: str, size_bytes: int | None = None) -> None:
        """Give back ``size_bytes`` of ``part`` (all of it when None)."""
        held = self.parts.get(part, 0)
        size = held if size_bytes is None else min(size_bytes, held)
        if size <= 0:
            return
        self.gpu.free(size)
        self.parts[part] = held - size

    def peak(self, part: str, size_bytes: int) -> None:
        """A transient peak (a profiling pass's activations): taken, then given back, as torch
        does with ``empty_cache()`` after profiling."""
        self.allocate(part, size_bytes)
        self.free(part, size_bytes)

    def held_bytes(self) -> int:
        return sum(self.parts.values())
