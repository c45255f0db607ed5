"""A vLLM TP worker process in kvcached mode, on its own simulated GPU, driven over stdin.

    python tp_worker.py USAGE_DIR TOTAL_BYTES RANK WORLD_SIZE

What vLLM's patched ``GPUModelRunner`` does in a worker with ``ENABLE_KVCACHED=1``: kvcached's
own vLLM integration initialises the worker (``init_kvcached(is_worker=True)``, which starts
kvcached's real IPC listener) and creates its KV tensors (``alloc_kv_cache``, or on vLLM's Model
Runner V2 kvcached's ``model_runner_v2.allocate_kv_cache``: :mod:`kv_model`).  Only
``kvcached.vmm_ops`` is a double (pages cost memory on the simulated GPU only once mapped).
The broker adapter arrives as it does in production: the ``kvcached_broker_autopatch.pth`` hook
(``ENABLE_KVCACHED=1``), plus ``import kvcached.autopatch`` for kvcached's own ``.pth``.  The
broker is ``KVCACHED_BROKER``; the instance ``KVCACHED_BROKER_INSTANCE`` (set by the test).

Requests are JSON lines, one JSON line back each:

* ``{"op": "status"}``: this worker's bytes on its GPU, what the vmm double has mapped, its
  grant holder's status (the group's holder now), its gate and its board file;
* ``{"op": "pin_bound", "pages": N}``: set the gate's bound to N pages (a worker whose grant is
  below what EngineCore may map: a race the design excludes, forced to check the rollback);
* ``{"op": "recreate"}``: kvcached creates the group's KV tensors again (the same call);
* ``{"op": "create"}``: with ``KVB_TEST_DEFER_TENSORS=1`` the KV tensors are created only now (a
  worker that registers late, after EngineCore started governing);
* ``{"op": "activate"}``: with ``KVB_TEST_HOLD_ACTIVATE=1`` the grant holder's first step with a
  governing engine (opening its broker session) waits until now;
* ``{"op": "exit"}``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # line_replies
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kv_model  # the test model, as this vLLM's kvcached integration lays it out
import line_replies

sys.path.remove(str(Path(__file__).resolve().parents[1]))  # only line_replies is wanted from there

reply = line_replies.open_channel()


def main(argv: list[str]) -> None:
    usage_dir, total_bytes, rank, world_size = Path(argv[0]), int(argv[1]), int(argv[2]), int(argv[3])
    from kvcached_broker.tools.kvcached_sim import kvcached_cpu

    gpu = kvcached_cpu.install(usage_dir, total_bytes, os.environ["KVCACHED_IPC_NAME"])
    import torch

    torch.cuda.synchronize = lambda *args, **kwargs: None  # the listener syncs before an unmap
    import kvcached.autopatch  # noqa: F401  (what kvcached's own .pth does)
    from kvcached import vmm_ops
    from kvcached.integration.vllm import interfaces

    from kvcached_broker.adapters import kvcached as kvmode
    from kvcached_broker.adapters.kvcached import runner
    from kvcached_broker.adapters.kvcached.broadcast import map_gate, worker_grants

    activation = threading.Event()
    if os.environ.get("KVB_TEST_HOLD_ACTIVATE") == "1":
        activate = worker_grants.WorkerGrants._activate

        def held_activate(self):
            activation.wait()
            return activate(self)

        worker_grants.WorkerGrants._activate = held_activate
    created: list = []  # the create_kv_tensors calls (args, kwargs), to replay one
    create_kv_tensors = interfaces.create_kv_tensors  # the broker's wrapper around kvcached's

    def recording_create(*args, **kwargs):
        created.append((args, kwargs))
        return create_kv_tensors(*args, **kwargs)

    interfaces.create_kv_tensors = recording_create
    interfaces.init_kvcached(tp_rank=rank, world_size=world_size, pp_rank=0, is_worker=True, device="cuda:0")
    from vllm.config import DeviceConfig, VllmConfig

    vc = VllmConfig(device_config=DeviceConfig(device="cpu"))

    def create() -> None:
        kv_model.create_worker_tensors(vc)

    if os.environ.get("KVB_TEST_DEFER_TENSORS") != "1":
        create()
    reply({"ready": True, "pid": os.getpid(), "registered": worker_grants.holder(0) is not None})
    for line in sys.stdin:
        request = json.loads(line)
        op = request["op"]
        holder = worker_grants.holder(0)
        if op == "status":
            gate = map_gate.existing(0)
            board = holder.board if holder is not None else None
            reply({"pid": os.getpid(), "device_bytes": gpu.mine_bytes(), "vmm_mapped_bytes": vmm_ops.mapped_bytes(0),
                   "holder": holder.status() if holder is not None else None, "holder_id": id(holder),
                   "gate": None if gate is None else {"bound_pages": gate.bound_pages,
                                                      "mapped_pages": gate.mapped_pages(),
                                                      "refused_maps": gate.refused_maps},
                   "board": None if board is None else {"path": board.path, "inode": board._identity.st_ino},
                   "pools": kvmode.status()})
        elif op == "pin_bound":
            gate = map_gate.gate(0)
            with gate.lock:
                gate.bound_pages = int(request["pages"])
            holder.governed = False  # stop following the engine, so the pinned bound stays
            reply({"bound_pages": gate.bound_pages})
        elif op == "recreate":
            args, kwargs = created[-1]
            interfaces.create_kv_tensors(*args, **kwargs)
            reply({"holder_id": id(worker_grants.holder(0))})
        elif op == "create":
            create()
            reply({"registered": worker_grants.holder(0) is not None})
        elif op == "activate":
            activation.set()
            reply({"activated": True})
        elif op == "settle":
            reply({"settled": runner.settle()})
        elif op == "exit":
            reply({"bye": True})
            return


if __name__ == "__main__":
    main(sys.argv[1:])
