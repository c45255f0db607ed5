"""A DeepSeek-V4-shaped serving process on a shared simulated GPU, driven over stdin, for the demo.

    python -m kvcached_broker.tools.dsv4_server USAGE_DIR TOTAL_BYTES INSTANCE

It is not SGLang: it goes through the memory side of an SGLang DeepSeek-V4 rank's start-up
with the broker adapters' own start-up calls (:mod:`kvcached_broker.adapters.sizing` and
:mod:`kvcached_broker.adapters.device_session`, which speak the client API), and every byte it takes
lands on the shared simulated device as it is taken (:class:`.shared_gpu.Footprint`).  Its
pool sizes come from a DeepSeek-V4-Flash-like shape (:mod:`.dsv4_shape`).  ``KVCACHED_BROKER``
names the broker.  Requests are JSON lines; each gets one JSON line back:

* ``{"op": "load", "weights_bytes": N}``: open the session, touch the GPU (a CUDA context,
  torch's first segment) and load the weights;
* ``{"op": "size", "mem_fraction_static": F, "max_running_requests": R}``: SGLang's own
  figures (the slack is ``(1 - F)`` of what was free before the weights loaded, the KV cache
  what is free now beyond it), admitted in one broker request (phase ``sizing``): the slack
  held in full, the KV cache held at the most that fits;
* ``{"op": "build"}``: the DeepSeek-V4 pools for the held KV size, allocated, then reported
  per pool with the KV hold turned into them in one request (phase ``warming``);
* ``{"op": "warm_up", "graphs_bytes": G, "activations_bytes": A}``: CUDA graphs and the
  warm-up's activations, out of the slack hold; then the warm-up settles (phase ``serving``:
  the base pinned where the device measures it, the unused slack kept as ``runtime_slack``);
* ``{"op": "exit"}``.

A reply carries ``footprint`` (what the process holds on the device, by purpose) and, for a
refusal or an out-of-memory error, ``refused`` or ``crashed`` with the one-line message.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Callable

from .dsv4_shape import Dsv4Shape

#: The least KV cache the server starts with (SGLang needs room for a few requests).
MIN_KV_BYTES = 512 << 20


class Dsv4Server:
    """One rank's start-up, step by step.  Sizes in bytes."""

    def __init__(self, usage_dir: Path, total_bytes: int, instance: str, *, tp_size: int = 8):
        from ..adapters.worker_identity import WorkerIdentity
        from .shared_gpu import Footprint, SharedGpu

        self.gpu = SharedGpu(usage_dir, total_bytes)
        self.memory = Footprint(self.gpu)
        self.identity = WorkerIdentity("sglang", 0, tp_rank=0, tp_size=tp_size, instance=instance)
        self.shape = Dsv4Shape()
        self.free_before_weights_bytes = 0
        self.kv_bytes = 0

    def load(self, weights_bytes: int) -> dict:
        from ..adapters import sessions

        if sessions.session(self.identity) is None:
            return {"refused": "no broker session (see this process's stderr)"}
        self.memory.touch()
        self.free_before_weights_bytes = self.gpu.free_bytes()
        self.memory.allocate("weights", weights_bytes)
        return {}

    def size(self, mem_fraction_static: float, max_running_requests: int) -> dict:
        from ..adapters import sizing

        self.shape = Dsv4Shape(request_slots=max_running_requests + 1)
        slack_bytes = int(self.free_before_weights_bytes * (1 - mem_fraction_static))
        asked_bytes = max(0, self.gpu.free_bytes() - slack_bytes)
        ask = sizing.StartupAsk("SGLang", asked_bytes, MIN_KV_BYTES, slack_bytes)
        try:
            sized = sizing.size(self.identity, ask)
        except sizing.StartupRefused as exc:
            return {"refused": str(exc)}
        if sized is None:
            return {"refused": "the worker runs unprotected (see this process's stderr)"}
        self.kv_bytes = sized.kv_bytes
        return {"asked_kv_bytes": asked_bytes, "kv_bytes": sized.kv_bytes, "slack_bytes": sized.slack_bytes}

    def build(self) -> dict:
        from ..adapters import sessions

        pools = self.shape.pools(self.shape.full_tokens_for(self.kv_bytes))
        for name, size_bytes in pools.items():
            self.memory.allocate(name, size_bytes)
        session = sessions.session(self.identity)
        if session is not None:
            session.report_built("dsv4_pools", pools, last=True, phase="warming")
        return {"pools": pools, "full_tokens": self.shape.full_tokens_for(self.kv_bytes)}

    def warm_up(self, graphs_bytes: int, activations_bytes: int) -> dict:
        from ..adapters import sessions

        self.memory.allocate("cuda_graphs", graphs_bytes)
        self.memory.allocate("activations", activations_bytes)
        session = sessions.session(self.identity)
        kept = session.settle_warm_up() if session is not None else None
        return {"slack_kept_bytes": kept}


def serve(server: Dsv4Server, lines, reply) -> None:
    """Answer one JSON line per request line until ``exit`` or the end of input."""
    from ..client import BudgetExceeded
    from .shared_gpu import DeviceFull

    for line in lines:
        request = json.loads(line)
        op = request.pop("op")
        if op == "exit":
            reply({"bye": True})
            return
        steps: dict[str, Callable[..., dict]] = {"load": server.load, "size": server.size, "build": server.build,
                                                 "warm_up": server.warm_up}
        step = steps[op]
        try:
            answer = step(**request)
        except BudgetExceeded as exc:
            answer = {"refused": exc.message}
        except DeviceFull as exc:
            answer = {"crashed": str(exc)}
        reply({**answer, "footprint": server.memory.parts, "device_bytes": server.gpu.mine_bytes()})


def main(argv: list[str]) -> int:
    usage_dir, total_bytes, instance = Path(argv[0]), int(argv[1]), argv[2]
    server = Dsv4Server(usage_dir, total_bytes, instance)

    def reply(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    reply({"ready": True, "pid": os.getpid()})
    serve(server, sys.stdin, reply)
    from ..adapters import process_state

    process_state.reset()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
