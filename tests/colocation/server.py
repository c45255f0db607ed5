"""One serving process of the co-located start-up test, on a shared simulated GPU, over stdin.

    python server.py ROLE USAGE_DIR TOTAL_BYTES SPEC_JSON

``ROLE`` is ``dsv4`` (SGLang, a DeepSeek-V4 pool with its side pools), ``mha`` (SGLang, a static
MHA pool) or ``vllm`` (vLLM, a static KV buffer); each runs inside its runtime's overlay with
``ENABLE_KVCACHED=1``, so the broker's adapters patch the runtime by the startup hook alone, and
``KVCACHED_BROKER`` names the broker.  (The kvcached-mode server is ``adapters/sglang/sglang_rank.py``,
whose ``start_up`` op does the same steps.)

It prints ``{"event": "ready", "pid": ...}`` and waits for a line (the moment every server
starts), then goes through its runtime's start-up as a real server does, with every byte it
takes landing on the shared device as it is taken (``tools.shared_gpu.Footprint``): the CUDA
context and torch's first segment, the weights, the runtime's own sizing (SGLang's real
``_profile_available_bytes`` on the device's free memory; vLLM's profiling pass, whose
activation peak is taken and freed, and its CUDA graph estimate), the pools built with the
runtime's own classes (SGLang's padding included), the CUDA graphs and the warm-up's
activations, inside the scheduler's (SGLang) or worker's (vLLM) start-up method as the
adapters patch it.  Then one line: ``serving`` (with what it holds), ``refused`` (the start-up
error the adapters raised: one line naming the broker and the room) or ``crashed`` (CUDA's
out-of-memory error: what the broker exists to prevent).  Once serving, each line ``batch``
runs a prefill whose activations use the rest of the slack the runtime kept (torch's cache
keeps them), and answers ``batched`` or ``crashed``; end of input exits.

``SPEC_JSON``: ``weights_bytes``, ``graphs_bytes``, ``warmup_bytes`` (activations left cached by
the warm-up), ``batch_bytes`` (a later prefill's activations), and per runtime
``mem_fraction_static`` (SGLang) or ``gpu_memory_utilization`` and ``profile_peak_bytes`` (vLLM).
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
sys.path[:0] = [str(HERE), str(TESTS), str(TESTS / "adapters" / "sglang"), str(TESTS / "adapters" / "vllm")]

GIB = 1 << 30


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


class Server:
    def __init__(self, role: str, usage_dir: Path, total_bytes: int, spec: dict):
        from kvcached_broker.tools.shared_gpu import Footprint, SharedGpu

        self.role = role
        self.spec = spec
        self.gpu = SharedGpu(usage_dir, total_bytes)
        self.memory = Footprint(self.gpu)
        self.kv_bytes = 0

    # ------------------------------------------------------------ SGLang
    def sglang_start(self) -> None:
        import sglang_cpu

        from kvcached_broker.adapters.sglang import kv_sizing, startup

        profiler = sglang_cpu.profiler(0)
        profiler.model_config = types.SimpleNamespace(is_multimodal=False)
        sys.modules[type(profiler).__module__].get_available_gpu_memory = (
            lambda *args, **kwargs: self.gpu.free_bytes() / GIB)  # cudaMemGetInfo, on the shared device
        owner = self._owner()

        def init_model_worker(scheduler) -> None:  # what SGLang's does, as far as memory goes
            pre_model_load_bytes = self.gpu.free_bytes()
            self.memory.allocate("weights", self.spec["weights_bytes"])
            with sglang_cpu.runtime_config(mem_fraction_static=self.spec["mem_fraction_static"]):
                self.kv_bytes = profiler._profile_available_bytes(pre_model_load_bytes / GIB)
            kv_sizing.wrap_init_pools(self._build_pools)(owner)
            self.memory.allocate("cuda_graphs", self.spec["graphs_bytes"])
            self.memory.allocate("activations", self.spec["warmup_bytes"])

        startup.wrap_init_model_worker(init_model_worker)(None)

    def _owner(self):
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        return types.SimpleNamespace(spec_algorithm=SpeculativeAlgorithm["NONE"], is_draft_worker=False,
                                     device="cpu", gpu_id=0, token_to_kv_pool=None, unified_memory_pool=None)

    def _build_pools(self, owner) -> None:
        """SGLang's ``_init_pools`` for this model: its own pool class, sized from the budget it
        was given, its bytes taken on the device as CUDA would as it is built."""
        import sglang_cpu

        from kvcached_broker.adapters.tensors import storage_bytes

        if self.role == "dsv4":
            units = sglang_cpu.dsv4_units_for(self.kv_bytes)
            if units <= 0:
                raise RuntimeError(f"the KV budget of {self.kv_bytes} bytes holds no DeepSeek-V4 pool unit")
            pool = sglang_cpu.build_dsv4_pool(4 * units, units)
            self.memory.allocate("kv_cache", sglang_cpu.unique_storage_bytes(pool))
        else:
            import torch
            from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

            layers, heads, head_dim, page = 32, 8, 128, 64
            cell_bytes = layers * 2 * heads * head_dim * torch.bfloat16.itemsize
            tokens = self.kv_bytes // cell_bytes // page * page  # SGLang floors to the page size...
            if tokens <= 0:
                raise RuntimeError(f"the KV budget of {self.kv_bytes} bytes holds no page of KV cache")
            pool = MHATokenToKVPool(tokens, page, torch.bfloat16, heads, head_dim, layers, "cpu", False)
            self.memory.allocate("kv_cache", storage_bytes([pool.k_buffer, pool.v_buffer]))  # ...then pads a page
        owner.token_to_kv_pool = pool

    # ------------------------------------------------------------ vLLM
    def vllm_start(self) -> None:
        import vllm.v1.worker.gpu_worker  # noqa: F401  - patched on import, as a server's is
        import vllm_shapes as shapes

        from kvcached_broker.adapters.vllm import kv_sizing

        w = shapes.gpu_worker(max_model_len=8192)
        spec, memory = self.spec, self.memory
        memory.allocate("weights", spec["weights_bytes"])

        def profile(worker) -> int:  # vLLM's determine_available_memory, as far as memory goes
            peak, graphs = spec["profile_peak_bytes"], spec["graphs_bytes"]
            memory.peak("activations", peak)  # the profiling pass; torch empties its cache after
            worker.peak_activation_memory = peak + graphs  # CUDA graphs' estimate applied (vLLM >= 0.21)
            worker.cudagraph_memory_estimate = graphs
            requested = int(spec["gpu_memory_utilization"] * self.gpu.total_bytes)
            return requested - memory.held_bytes() - peak - graphs

        self.kv_bytes = kv_sizing.wrap_determine_available_memory(profile)(w)
        vc, kv_cfg = shapes.hybrid_config(self.kv_bytes)
        buffers = shapes.allocate(vc, kv_cfg)
        from kvcached_broker.adapters.tensors import storage_bytes

        memory.allocate("kv_cache", storage_bytes(buffers))

        def compile_or_warm_up_model(worker) -> None:
            memory.allocate("cuda_graphs", spec["graphs_bytes"])
            memory.allocate("activations", spec["warmup_bytes"])

        kv_sizing.wrap_compile_or_warm_up_model(compile_or_warm_up_model)(w)

    # ------------------------------------------------------------ serving
    def batch(self) -> None:
        """A later prefill: more activations, inside the slack the runtime kept."""
        self.memory.allocate("activations", self.spec["batch_bytes"])


def main(argv: list[str]) -> int:
    role, usage_dir, total_bytes, spec = argv[0], Path(argv[1]), int(argv[2]), json.loads(argv[3])
    import device_memory

    device_memory.enter()
    from kvcached_broker.adapters.sglang.kv_budget import BrokerBudgetError
    from kvcached_broker.adapters.vllm.kv_budget import KVCacheBudgetError
    from kvcached_broker.tools.shared_gpu import DeviceFull

    server = Server(role, usage_dir, total_bytes, spec)
    say(event="ready", pid=os.getpid())
    if not sys.stdin.readline():
        return 0
    try:
        server.memory.touch()
        server.vllm_start() if role == "vllm" else server.sglang_start()
    except (BrokerBudgetError, KVCacheBudgetError) as exc:
        say(event="refused", error=str(exc), footprint=server.memory.parts)
        sys.stdin.read()
        return 3
    except DeviceFull as exc:
        say(event="crashed", error=str(exc), footprint=server.memory.parts)
        sys.stdin.read()
        return 4
    say(event="serving", kv_bytes=server.kv_bytes, footprint=server.memory.parts)
    for _line in sys.stdin:
        try:
            server.batch()
            say(event="batched", footprint=server.memory.parts)
        except DeviceFull as exc:
            say(event="crashed", error=str(exc), footprint=server.memory.parts)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
