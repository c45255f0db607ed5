"""The co-located start-up of the whole-footprint issue, with real allocations: the GPU check's part.

Several serving processes start at the same moment on one device under one broker.  Each
takes every byte of its start-up as a serving process does, through torch on a GPU (its
caching allocator over ``cudaMalloc``) or on the shared simulated device with ``--simulate``:
its weights, then its own sizing by the adapters' one algorithm (:mod:`..adapters.sizing`:
the base pinned, the slack it keeps for activations and CUDA graphs held, the KV cache held as
much as fits), its KV pool (reported as ``kv_static``, the hold turned into it in one request),
its CUDA graphs and the activations its warm-up leaves in torch's cache, then the end of its
warm-up (:meth:`..adapters.device_session.DeviceSession.settle_warm_up`) and a later, larger batch.  No SGLang or vLLM
is needed: the allocations stand in for theirs, and the broker's part is the adapters' own.

What is checked, at every sample and at the end: the device holds no more than its total; no
process meets an out-of-memory error; each either serves or its start is refused with one
line naming the broker; every serving process's books (what it reported and was promised)
cover what the device measures it using; nothing is overcommitted once all are up.
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

#: name -> the start-up, as shares of the device's total (a real 80 GiB GPU or the simulated one)
SERVERS: dict[str, dict[str, float]] = {
    # SGLang-like: keeps 12% of what it saw before its weights as slack; capped by its operator
    "sglang-dsv4": {"weights": 0.17, "slack_of_free": 0.12, "cap": 0.36, "graphs": 0.012, "warmup": 0.025,
                    "batch": 0.03},
    # vLLM-like: its profile's activation peak and graph estimate; 30% of the device requested
    "vllm-qwen": {"weights": 0.08, "slack_peak": 0.025, "slack_graphs": 0.01, "requested": 0.30, "cap": 0.0,
                  "graphs": 0.01, "warmup": 0.012, "batch": 0.012},
    # another SGLang-like server, 10% slack, capped
    "sglang-llama": {"weights": 0.08, "slack_of_free": 0.10, "cap": 0.22, "graphs": 0.006, "warmup": 0.012,
                     "batch": 0.025},
}


def start_up(memory: Any, request: dict[str, Any]) -> dict[str, Any]:
    """One serving process's start-up (in a GPU-check worker process, ``memory`` its device):
    ``request`` names the broker's ``endpoint``, the ``instance`` and the byte figures.  Returns
    ``{"event": "serving" | "refused" | "crashed", ...}`` (a refusal's or crash's one line in
    ``message``: an ``error`` key is the worker protocol's own failure)."""
    from ..adapters import sessions, sizing
    from ..adapters.worker_identity import WorkerIdentity

    endpoint, instance = request["endpoint"], request["instance"]
    sessions.set_client_factory(lambda ident: sessions.connect(ident, endpoint=endpoint))
    identity = WorkerIdentity("sglang", 0, instance=instance)
    taken: dict[str, int] = {}

    def take(part: str, size_bytes: int) -> None:
        memory.alloc(size_bytes)
        taken[part] = taken.get(part, 0) + size_bytes

    try:
        memory.context()
        free_before = int(request["free_before_bytes"])
        take("weights", int(request["weights_bytes"]))
        slack = int(request["slack_bytes"]) or int(free_before * float(request.get("slack_of_free", 0.0)))
        ask = sizing.StartupAsk("a serving", int(request["kv_bytes"]), int(request["kv_min_bytes"]), slack)
        sized = sizing.size(identity, ask)
        session = sessions.session(identity)
        if sized is None or session is None:
            return {"event": "unprotected", "taken": taken}
        take("kv_cache", sized.kv_bytes)
        session.report_built("kv", {"kv_static": sized.kv_bytes}, last=True, phase="warming")
        take("cuda_graphs", int(request["graphs_bytes"]))
        take("activations", int(request["warmup_bytes"]))
        kept = session.settle_warm_up()
    except sizing.StartupRefused as exc:
        return {"event": "refused", "message": str(exc), "taken": taken}
    except (RuntimeError, MemoryError) as exc:  # torch's OutOfMemoryError, the simulated DeviceFull
        return {"event": "crashed", "message": " ".join(str(exc).split())[:300], "taken": taken}
    return {"event": "serving", "kv_bytes": sized.kv_bytes, "slack_bytes": slack, "slack_kept_bytes": kept,
            "taken": taken}


def batch(memory: Any, size_bytes: int) -> dict[str, Any]:
    """A later batch's activations, inside the slack kept for them."""
    try:
        memory.alloc(size_bytes)
    except (RuntimeError, MemoryError) as exc:
        return {"event": "crashed", "message": " ".join(str(exc).split())[:300]}
    return {"event": "batched"}


@dataclass
class Sampler:
    """Reads the device and the broker together until stopped (on the simulated device under
    its allocation lock; on a GPU one reading after the broker's status, so the device's figure
    is the later one and errs against the check)."""

    ctx: Any
    broker: Any
    pids: dict[int, str]
    serving: set[int] = field(default_factory=set)
    samples: int = 0
    violations: list[str] = field(default_factory=list)

    def run(self, stop: threading.Event) -> None:
        probe = self.ctx.device.probe()
        while not stop.wait(0.05):
            with self.ctx.device.quiesced():
                status = self.broker.status()
                reading = probe.read()
            self.samples += 1
            used = reading.used_bytes if reading.used_bytes is not None else sum(reading.process_bytes.values())
            if used > reading.total_bytes:
                self.violations.append(f"the device holds {used} of {reading.total_bytes} bytes")
            books = books_by_pid(status)
            for pid in list(self.serving):
                if reading.process_bytes.get(pid, 0) > books.get(pid, 0):
                    self.violations.append(f"{self.pids[pid]} uses {reading.process_bytes.get(pid, 0)} bytes, "
                                           f"its books cover {books.get(pid, 0)}")


def books_by_pid(status: dict[str, Any]) -> dict[int, int]:
    """What each process's sessions reported resident or were promised (pools, holds, pages)."""
    books: dict[int, int] = {}
    for instance in status["instances"]:
        for s in instance["sessions"]:
            books[s["pid"]] = books.get(s["pid"], 0) + s["reserved_bytes"] + s["granted_pages"] * s["page_bytes"]
    return books


def gpu_check(ctx: Any) -> None:
    """The GPU check's ``colocated_start`` part (:mod:`.gpu_check.parts`)."""
    from .gpu_check.workers import start_workers

    rec = ctx.record
    total = ctx.device.total_bytes()
    rec.assume(crashed_servers=0, over_total_samples=0, uncovered_samples=0)
    with ExitStack() as stack:
        launcher = ctx.device.broker("colocation")
        broker = stack.enter_context(launcher)
        with broker.admin() as admin:
            for name, shape in SERVERS.items():
                if shape.get("cap"):
                    admin.limit(name, max_bytes=int(shape["cap"] * total))
        workers = start_workers(ctx.device, list(SERVERS))
        for w in workers:
            stack.callback(w.stop)
        free_before = total - sum(ctx.device.probe().read().process_bytes.values())
        sampler = Sampler(ctx, broker, {w.pid: w.name for w in workers})
        stop = threading.Event()
        thread = threading.Thread(target=sampler.run, args=(stop,), daemon=True)
        thread.start()
        started = time.monotonic()
        for w in workers:  # the same moment: every request sent before any answer is read
            w.send("start_up", **_request(SERVERS[w.name], total, free_before, broker.endpoint, w.name))
        outcomes = {w.name: w.receive(timeout_s=max(30.0, ctx.left_s() - 20)) for w in workers}
        rec.figure("start_up_s", round(time.monotonic() - started, 3))
        for w in workers:
            if outcomes[w.name]["event"] == "serving":
                sampler.serving.add(w.pid)
        batches = {w.name: w.request("batch", bytes=int(SERVERS[w.name]["batch"] * total))
                   for w in workers if outcomes[w.name]["event"] == "serving"}
        time.sleep(0.2)  # a few more samples with every batch taken
        stop.set()
        thread.join(timeout=10)
        status = broker.status()
    for name, outcome in outcomes.items():
        rec.figure(f"{name}_event", outcome["event"])
        for part, size in outcome.get("taken", {}).items():
            rec.figure(f"{name}_{part}_bytes", size)
        if outcome["event"] == "refused":
            rec.check(f"{name}_refused_in_one_line", "\n" not in outcome["message"] and broker.endpoint in outcome["message"],
                      outcome["message"][:300])
    crashed = [n for n, o in {**outcomes, **batches}.items() if o["event"] == "crashed"]
    rec.figures(crashed_servers=len(crashed), samples=sampler.samples,
                over_total_samples=sum("device holds" in v for v in sampler.violations),
                uncovered_samples=sum("books cover" in v for v in sampler.violations),
                overcommitted_at_end=bool(status["overcommitted"]))
    rec.check("no_server_met_out_of_memory", not crashed, json.dumps({n: outcomes.get(n, batches.get(n)) for n in crashed})[:500])
    rec.check("every_serving_process_covered_at_every_sample", not sampler.violations, "; ".join(sampler.violations[:3]))
    rec.check("not_overcommitted_once_all_are_up", not status["overcommitted"])
    rec.check("some_server_serves", any(o["event"] == "serving" for o in outcomes.values()))


def _request(shape: dict[str, float], total: int, free_before: int, endpoint: str, instance: str) -> dict[str, Any]:
    """The worker's ``start_up`` request for ``shape`` on a device of ``total`` bytes."""
    weights = int(shape["weights"] * total)
    if "requested" in shape:  # vLLM-like: its profile's peak and graphs, its requested share less both
        slack = int((shape["slack_peak"] + shape["slack_graphs"]) * total)
        kv = int(shape["requested"] * total) - weights - slack
        kv_min = max(1, kv // 64)
        slack_of_free = 0.0
    else:  # SGLang-like: its slack from what it saw, its KV from what is free less the slack
        slack = 0
        slack_of_free = shape["slack_of_free"]
        kv = free_before - weights - int(free_before * slack_of_free)
        kv_min = 1
    return {"endpoint": endpoint, "instance": instance, "free_before_bytes": free_before, "weights_bytes": weights,
            "slack_bytes": slack, "slack_of_free": slack_of_free, "kv_bytes": max(1, kv), "kv_min_bytes": kv_min,
            "graphs_bytes": int(shape["graphs"] * total), "warmup_bytes": int(shape["warmup"] * total),
            "pid": os.getpid()}
