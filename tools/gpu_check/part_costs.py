"""Part: what a process costs on the device before (and besides) what it allocates.

A fresh worker process goes step by step, and after each step the device's figure for it is
read once it stops moving: before any device call; the context (GPU 0 selected and
synchronised); torch's first allocation (1 byte: the caching allocator takes a whole block);
1 GiB more (the allocator's rounding); a small matrix product (cuBLAS's handle, workspace and
kernels); a one-rank NCCL group with one all-reduce; and what stays after everything is freed
and torch's cache emptied.  A second process makes a context too, to see whether the figure
repeats.

The simulated device assumes every one of these costs nothing beyond the bytes allocated.
With one rank NCCL needs no buffers for peers: a tensor-parallel group costs more.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from .context import PartContext
from .devices import GIB
from .workers import WorkerFailed, WorkerProcess, start_workers

SETTLE_S = 1.0


def run(ctx: PartContext) -> None:
    rec = ctx.record
    rec.assume(before_context_bytes=0, context_bytes=0, context_second_bytes=0, first_alloc_device_bytes=1,
               first_alloc_torch_reserved_bytes=1, alloc_1gib_overhead_bytes=0, matmul_bytes=0, nccl_bytes=0,
               after_free_bytes=0)
    with ExitStack() as stack:
        first, second = start_workers(ctx.device, ["cost-1", "cost-2"])
        stack.callback(first.stop)
        stack.callback(second.stop)
        steps = Steps(ctx, first)
        before = steps.reading()
        rec.figures(before_context_bytes=before["mine_bytes"], device_used_before_bytes=before["used_bytes"])
        steps.step("context", "context")
        alone = steps.last
        second_before = second.request("device")["mine_bytes"]
        second.request("context")
        rec.figure("context_second_bytes", second.request("device", settle_s=SETTLE_S)["mine_bytes"] - second_before)
        if alone is not None:
            rec.figure("context_device_used_bytes", alone["used_bytes"] - before["used_bytes"])
        steps.step("first_alloc_device", "alloc", bytes=1)
        if steps.own is not None:
            rec.figures(first_alloc_torch_reserved_bytes=steps.own["reserved_bytes"],
                        first_alloc_torch_allocated_bytes=steps.own["allocated_bytes"])
        steps.step("alloc_1gib", "alloc", bytes=GIB)
        if rec.data["figures"].get("alloc_1gib_bytes") is not None:
            rec.figure("alloc_1gib_overhead_bytes", rec.data["figures"]["alloc_1gib_bytes"] - GIB)
        steps.step("matmul", "matmul")
        steps.step("nccl", "nccl", dir=str(ctx.workdir))
        steps.step("free_all", "free_all")
        if steps.last is not None:
            rec.figure("after_free_bytes", steps.last["mine_bytes"])


class Steps:
    """One worker's steps; after each, the growth of its device figure is ``{name}_bytes``."""

    def __init__(self, ctx: PartContext, worker: WorkerProcess):
        self.ctx = ctx
        self.worker = worker
        self.last: dict[str, Any] | None = None
        self.own: dict[str, Any] | None = None

    def reading(self) -> dict[str, Any]:
        self.last = self.worker.request("device", settle_s=SETTLE_S)
        return self.last

    def step(self, name: str, op: str, **args: Any) -> None:
        """Run ``op``; record ``{name}_bytes`` (the device figure's growth) and ``{name}_s`` (its
        time).  A failed step is a note and None figures: the next steps still run."""
        rec = self.ctx.record
        before = self.last or self.reading()
        try:
            answer = self.worker.request(op, timeout_s=max(5.0, min(60.0, self.ctx.left_s() - 5.0)), **args)
        except WorkerFailed as exc:
            rec.figures(**{f"{name}_bytes": None, f"{name}_s": None})
            rec.note(f"{name}: {exc}")
            self.own = None
            self.last = None
            return
        self.own = answer
        after = self.reading()
        rec.figures(**{f"{name}_bytes": after["mine_bytes"] - before["mine_bytes"], f"{name}_s": answer["s"]})
