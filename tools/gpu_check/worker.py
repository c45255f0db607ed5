"""A process that takes device memory when told to, for the GPU check: one JSON line per request.

    python -m kvcached_broker.tools.gpu_check.worker gpu
    python -m kvcached_broker.tools.gpu_check.worker simulate USAGE_DIR TOTAL_BYTES

On a GPU it allocates through torch, as a serving process does (torch's caching allocator on
top of ``cudaMalloc``); on the simulated device it allocates on the device that processes
share (:class:`kvcached_broker.tools.shared_gpu.SharedGpu`), where a process uses exactly
what it allocated.  It first writes ``{"ready": true, "pid": PID}``; then, one request per
line, each answered by one line (``{"error": "..."}`` if the request failed):

* ``{"op": "context"}``: create the device context (torch: select GPU 0 and synchronise);
* ``{"op": "alloc", "bytes": N}``: take N more bytes; ``{"op": "free_all"}``: give every
  allocation back (torch: and empty its cache, so the driver gets the memory back);
  ``{"op": "free_last"}``: the newest allocation only;
* ``{"op": "matmul"}``: one small matrix product (torch: loads cuBLAS and its workspace);
* ``{"op": "nccl", "dir": PATH}``: a one-rank NCCL process group and one all-reduce;
* ``{"op": "own"}``: what the allocator says it holds (``allocated_bytes``, ``reserved_bytes``);
* ``{"op": "device"}``: what the device says this process and the device use now;
  ``"settle_s": S`` first waits (up to S) until this process's figure stops changing;
* ``{"op": "report", "endpoint": E, "instance": I, "pools": {...}, "measured_base": B}``: open
  a broker session (once) and ``reserve`` those pools;
* ``{"op": "start_up", ...}``: a serving process's start-up under the broker
  (:func:`kvcached_broker.tools.colocation.start_up`), answered ``serving``, ``refused`` or
  ``crashed``; ``{"op": "batch", "bytes": N}``: a later batch's activations (``crashed`` on an
  out-of-memory error);
* ``{"op": "lag", "bytes": N, "trials": K, "wait_s": T}``: K times, allocate N bytes and
  poll the device (as the broker reads it) until it shows them, then free them (and only them)
  and poll until it shows that: how long each took and how many reads it took (None: not within T);
* ``{"op": "exit"}``.

On the simulated device, ``context``, ``matmul`` and ``nccl`` take nothing: the simulated
device charges a process only for what it allocates.  That is the assumption the GPU check
measures against a GPU, so those operations are the simulation's behaviour, not stand-ins.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ...broker.device import DeviceProbe, NvmlDevice, SimulatedDevice

if TYPE_CHECKING:
    from ...client import BrokerClient


class TorchMemory:
    """Memory on GPU 0 through torch, as a serving process takes it."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.tensors: list[Any] = []

    def context(self) -> None:
        self.torch.cuda.set_device(0)
        self.torch.cuda.synchronize()  # the first runtime call that needs it creates the primary context

    def alloc(self, size_bytes: int) -> None:
        self.tensors.append(self.torch.empty(size_bytes, dtype=self.torch.uint8, device="cuda:0"))
        self.torch.cuda.synchronize()

    def free_all(self) -> None:
        self.tensors.clear()
        self._give_back()

    def free_last(self) -> None:
        self.tensors.pop()
        self._give_back()

    def _give_back(self) -> None:
        self.torch.cuda.synchronize()
        self.torch.cuda.empty_cache()  # cached blocks nothing uses go back to the driver

    def matmul(self) -> None:
        a = self.torch.ones((1024, 1024), device="cuda:0")
        (a @ a).sum().item()
        del a
        self.torch.cuda.synchronize()

    def nccl(self, workdir: Path) -> None:
        import torch.distributed as dist

        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")  # one rank: nothing leaves the machine
        store = dist.FileStore(str(workdir / "nccl-store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=self.torch.device("cuda", 0))
        t = self.torch.ones(1, device="cuda:0")
        dist.all_reduce(t)  # NCCL builds its communicator on the first collective
        self.torch.cuda.synchronize()

    def own(self) -> dict[str, int]:
        return {"allocated_bytes": int(self.torch.cuda.memory_allocated(0)),
                "reserved_bytes": int(self.torch.cuda.memory_reserved(0))}


class SimulatedMemory:
    """The shared simulated device: a process uses exactly what it allocated, nothing else.

    ``context``, ``matmul`` and ``nccl`` take nothing, because the simulated device charges
    nothing for them (see the module's docstring)."""

    def __init__(self, usage_dir: Path, total_bytes: int):
        from ..shared_gpu import SharedGpu

        self.gpu = SharedGpu(usage_dir, total_bytes)
        self.sizes: list[int] = []

    @property
    def held_bytes(self) -> int:
        return sum(self.sizes)

    def context(self) -> None:
        pass

    def alloc(self, size_bytes: int) -> None:
        self.gpu.allocate(size_bytes)
        self.sizes.append(size_bytes)

    def free_all(self) -> None:
        self.gpu.free(self.held_bytes)
        self.sizes.clear()

    def free_last(self) -> None:
        self.gpu.free(self.sizes.pop())

    def matmul(self) -> None:
        pass

    def nccl(self, workdir: Path) -> None:
        pass

    def own(self) -> dict[str, int]:
        return {"allocated_bytes": self.held_bytes, "reserved_bytes": self.held_bytes}


def device_now(probe: DeviceProbe, settle_s: float = 0.0, step_s: float = 0.02) -> dict[str, Any]:
    """This process's and the device's figures; with ``settle_s``, once this process's figure
    has read the same three times in a row (NVML can trail an allocation), or ``settle_s`` passed."""
    pid = os.getpid()
    started = time.monotonic()
    reading = probe.read()
    same = 1
    while settle_s > 0 and same < 3 and time.monotonic() - started < settle_s:
        time.sleep(step_s)
        later = probe.read()
        same = same + 1 if later.process_bytes.get(pid) == reading.process_bytes.get(pid) else 1
        reading = later
    return {"mine_bytes": reading.process_bytes.get(pid, 0), "listed": pid in reading.process_bytes,
            "used_bytes": reading.used_bytes, "total_bytes": reading.total_bytes,
            "per_process": reading.per_process, "settled_s": time.monotonic() - started}


@dataclass
class Seen:
    """When a poll first saw a change: seconds after the change was made, and the reads it took
    (1: the first read after it already showed it).  None: not within the poll's time."""

    s: float | None = None
    reads: int | None = None


def watch(probe: DeviceProbe, before: dict[str, Any], delta_bytes: int, timeout_s: float,
          read_s: list[float]) -> tuple[Seen, Seen]:
    """Poll the device from now until this process's figure and the device's used figure have
    both moved by at least half of ``delta_bytes`` (in its direction) from ``before``; when
    each did.  Every read's duration goes to ``read_s``."""
    pid = os.getpid()
    half = delta_bytes // 2
    start = time.perf_counter()
    process, device = Seen(), Seen()
    reads = 0
    while (process.s is None or device.s is None) and time.perf_counter() - start < timeout_s:
        t0 = time.perf_counter()
        reading = probe.read()
        now = time.perf_counter()
        reads += 1
        read_s.append(now - t0)
        mine_moved = reading.process_bytes.get(pid, 0) - before["mine_bytes"]
        used_moved = (reading.used_bytes or 0) - (before["used_bytes"] or 0)
        if process.s is None and _moved(mine_moved, half):
            process = Seen(now - start, reads)
        if device.s is None and _moved(used_moved, half):
            device = Seen(now - start, reads)
    return process, device


def _moved(moved: int, half: int) -> bool:
    return moved >= half if half > 0 else moved <= half


def lag(memory, probe: DeviceProbe, size_bytes: int, trials: int, timeout_s: float) -> dict[str, Any]:
    """How long the device's figures trail an allocation and a free (see the module's docstring):
    for each of ``alloc_process``, ``alloc_device``, ``free_process``, ``free_device``, a list of
    seconds and a list of reads (``_s``, ``_reads``), one entry per trial; and every read's time."""
    out: dict[str, list] = {"read_s": []}
    for _ in range(trials):
        for event, act, delta in (("alloc", lambda: memory.alloc(size_bytes), size_bytes),
                                  ("free", memory.free_last, -size_bytes)):
            before = device_now(probe)
            act()
            process, device = watch(probe, before, delta, timeout_s, out["read_s"])
            for where, seen in (("process", process), ("device", device)):
                out.setdefault(f"{event}_{where}_s", []).append(seen.s)
                out.setdefault(f"{event}_{where}_reads", []).append(seen.reads)
    return out


class Worker:
    def __init__(self, memory, probe: DeviceProbe):
        self.memory = memory
        self.probe = probe
        self.client: BrokerClient | None = None

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request["op"]
        handlers: dict[str, Callable[[], dict[str, Any]]] = {
            "context": lambda: self._timed(self.memory.context),
            "alloc": lambda: self._timed(self.memory.alloc, int(request["bytes"])),
            "free_all": lambda: self._timed(self.memory.free_all),
            "free_last": lambda: self._timed(self.memory.free_last),
            "matmul": lambda: self._timed(self.memory.matmul),
            "nccl": lambda: self._timed(self.memory.nccl, Path(request["dir"])),
            "own": self.memory.own,
            "device": lambda: device_now(self.probe, float(request.get("settle_s", 0.0))),
            "report": lambda: self._report(request),
            "start_up": lambda: colocation().start_up(self.memory, request),
            "batch": lambda: colocation().batch(self.memory, int(request["bytes"])),
            "lag": lambda: lag(self.memory, self.probe, int(request["bytes"]), int(request["trials"]),
                               float(request.get("wait_s", 2.0))),
        }
        if op not in handlers:
            return {"error": f"unknown op {op!r}"}
        return handlers[op]()

    def _timed(self, fn: Callable[..., None], *args: Any) -> dict[str, Any]:
        started = time.perf_counter()
        fn(*args)
        return {"s": time.perf_counter() - started, **self.memory.own()}

    def _report(self, request: dict[str, Any]) -> dict[str, Any]:
        from ...client import BrokerClient

        if self.client is None:
            self.client = BrokerClient.connect(request["instance"], endpoint=request["endpoint"], credit_pages=0)
        pools = {name: int(size) for name, size in request["pools"].items()}
        return {"pools": self.client.reserve(pools, measured_base=bool(request.get("measured_base", False)))}

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


def colocation() -> Any:
    from .. import colocation as module

    return module


def build(argv: list[str]) -> Worker:
    if argv[:1] == ["gpu"] and len(argv) == 1:
        return Worker(TorchMemory(), NvmlDevice(0))
    if argv[:1] == ["simulate"] and len(argv) == 3:
        usage_dir, total_bytes = Path(argv[1]), int(argv[2])
        return Worker(SimulatedMemory(usage_dir, total_bytes), SimulatedDevice(0, total_bytes, usage_dir))
    raise SystemExit("usage: worker gpu | worker simulate USAGE_DIR TOTAL_BYTES")


def main(argv: list[str] | None = None) -> None:
    worker = build(sys.argv[1:] if argv is None else argv)
    reply({"ready": True, "pid": os.getpid()})
    try:
        for line in sys.stdin:
            request = json.loads(line)
            if request.get("op") == "exit":
                reply({"bye": True})
                return
            try:
                reply(worker.handle(request))
            except Exception as exc:  # noqa: BLE001 - one failed step must not end the others: the part records it
                reply({"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:500],
                       "trace": traceback.format_exc()[-2000:]})
    finally:
        worker.close()


def reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
