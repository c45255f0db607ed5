"""A vLLM worker process with both autopatches on: what the broker charges for kvcached's buffers.

    python coexistence_probe.py USAGE_DIR TOTAL_BYTES

``ENABLE_KVCACHED=1`` fires the ``kvcached_broker_autopatch.pth`` hook at interpreter start;
``import kvcached.autopatch`` is what kvcached's own ``.pth`` does.  Then vLLM is imported
(kvcached's hook patches it, importing the modules the broker's hook patches too), kvcached
initialises the worker as its patched ``GPUModelRunner.__init__`` does, and the probe:

1. sizes the KV cache through ``Worker.determine_available_memory`` (kvcached's process-local
   profile inside, with vLLM's GPU profile and torch's CUDA counters stood in: no GPU), with a
   whole-GPU virtual budget (what kvcached's patched ``request_memory`` gives);
2. allocates the KV cache through ``GPUModelRunner._allocate_kv_cache_tensors`` as patched (kvcached
   allocates its virtual buffers; on Model Runner V2, ``gpu.attn_utils.allocate_kv_cache`` inside
   kvcached's persistent allocation), and again through the broker's allocation wrapper alone;
3. prints one JSON line: the sizes, the wrapper chain and this worker's session in status.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kv_model  # the test model, as this vLLM's kvcached integration lays it out

#: The result goes out on the original stdout; everything else printed (kvcached prints) goes to stderr.
_result = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr


def main(argv: list[str]) -> None:
    usage, total = Path(argv[0]), int(argv[1])
    from kvcached_broker.tools.kvcached_sim import kvcached_cpu

    kvcached_cpu.install(usage, total, os.environ["KVCACHED_IPC_NAME"])
    import torch

    import kvcached.autopatch  # noqa: F401  (kvcached's .pth)
    import vllm  # noqa: F401
    from vllm.v1.worker import gpu_worker

    from kvcached.integration.vllm import interfaces as kvi
    from kvcached_broker.adapters import autopatch, sessions
    from kvcached_broker.adapters.tensors import storage_bytes
    from kvcached_broker.adapters.vllm import kv_reservation, parallel

    kvi.init_kvcached(tp_rank=0, world_size=1, pp_rank=0, is_worker=True, device="cuda:0")  # GPUModelRunner.__init__

    # 1. sizing: kvcached's profile (vLLM 0.8's path, no init snapshot) with a whole-GPU virtual budget
    for name, value in (("empty_cache", lambda: None), ("reset_peak_memory_stats", lambda: None),
                        ("memory_stats", lambda: {"allocated_bytes.all.peak": 0})):
        setattr(torch.cuda, name, value)
    method = gpu_worker.Worker.determine_available_memory
    w = object.__new__(gpu_worker.Worker)
    w.device = torch.device("cpu")
    w.cache_config = SimpleNamespace(kv_cache_memory_bytes=None)
    w.requested_memory = 80 << 30  # kvcached's virtual capacity: the whole (simulated 80 GiB) GPU
    w.init_snapshot = None
    w.model_config = SimpleNamespace(multimodal_config=None)
    w.parallel_config = SimpleNamespace()
    w.vllm_config = SimpleNamespace()
    w.model_runner = SimpleNamespace(profile_run=lambda: None, get_kv_cache_spec=lambda: {})
    sized = method(w)

    # 2. allocation: kvcached's virtual buffers, through the patched runner and our wrapper alone
    if kv_model.runner_v2():  # Model Runner V2: kvcached's allocate_kv_cache in place of vLLM's
        from vllm.config import DeviceConfig, VllmConfig
        from vllm.v1.worker.gpu import attn_utils, model_runner  # noqa: F401  (kvcached patches the runner)

        from kvcached.integration.vllm import model_runner_v2

        config, layout = kv_model.kv_cache_config(VllmConfig(device_config=DeviceConfig(device="cpu")))
        token = model_runner_v2._persistent_allocation.set(True)  # as kvcached's initialize_kv_cache sets it
        try:
            through_runner = attn_utils.allocate_kv_cache(config, "cuda:0", layout)
        finally:
            model_runner_v2._persistent_allocation.reset(token)
        through_ours = kv_reservation.wrap_allocate_function(model_runner_v2.allocate_kv_cache)(config, "cuda:0", layout)
    else:
        from vllm.v1.worker import gpu_model_runner

        def kvcached_buffers(_self=None, _config=None):
            return kv_model.create_worker_tensors(None)

        runner = SimpleNamespace(device=torch.device("cpu"),
                                 _allocate_kv_cache_from_kvcached=lambda cfg: kvcached_buffers())
        config = SimpleNamespace(num_blocks=4096, kv_cache_tensors=[], kv_cache_groups=[])
        through_runner = gpu_model_runner.GPUModelRunner._allocate_kv_cache_tensors(runner, config)
        through_ours = kv_reservation.wrap_allocate_method(kvcached_buffers)(runner, config)

    client = sessions.session(parallel.identity(0)).client
    status = client.status()
    (me,) = [s for i in status["instances"] for s in i["sessions"] if s["id"] == client.session_id]
    outer = gpu_worker.Worker.determine_available_memory
    _result.write(json.dumps({
        "hook": autopatch.hook_installed(), "sized_bytes": sized, "budget_bytes": status["budget_bytes"],
        "virtual_bytes": storage_bytes(through_runner), "virtual_bytes_ours": storage_bytes(through_ours),
        "outer_is_ours": bool(getattr(outer, "__kvcached_broker_wrapped__", False)),
        "wraps_kvcached": "GPUWorkerPatch" in getattr(getattr(outer, "__wrapped__", None), "__qualname__", ""),
        "pools": me["pools"], "holds": me["holds"],
    }) + "\n")
    _result.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
