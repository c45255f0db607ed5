"""vLLM's EngineCore in kvcached mode with TP workers in other processes, driven over stdin.

    python tp_engine.py USAGE_DIR TOTAL_BYTES WORLD_SIZE

With WORLD_SIZE 1 the worker runs in this process, as with vLLM's ``UniProcExecutor``: kvcached's
pool maps here, governed through this process's own broker session.

The real classes, on a CPU: the overlay's vLLM ``Scheduler`` (with kvcached's patches, its block pool
is kvcached's ``ElasticBlockPool`` over a real ``KVCacheManager(world_size=WORLD_SIZE)``, which
maps and unmaps through kvcached's real ``tp_ipc_util`` in the worker processes), and vLLM's
own EngineCore busy loop (``EngineCoreProc.run_busy_loop``, ``_process_input_queue``, idle-state
callbacks, ``WAKEUP``) on this process's main thread: the engine thread.  Only the model step is
absent: a prefill is scheduled and the request finished at once, so its full blocks stay in the
prefix cache as vLLM leaves them.  Both autopatches are on as in production (the
``kvcached_broker_autopatch.pth`` hook with ``ENABLE_KVCACHED=1``; ``import kvcached.autopatch``
for kvcached's ``.pth``).

Each request line runs on the engine thread (a ``UTILITY`` request on EngineCore's input queue)
and gets one JSON line back:

* ``{"op": "alloc", "blocks": N}``: ``ElasticBlockPool.get_new_blocks`` (a miss is
  ``{"got": null}``: kvcached's ``KVCachePoolExhausted``, which its ``allocate_slots`` patch
  turns into a scheduling miss); ``{"op": "fill", "blocks": N, "misses": M}`` allocates a page
  at a time until N more are held, retrying a miss after a governor round (M misses at most);
  ``{"op": "free", "blocks": N}`` frees the N newest;
* ``{"op": "prefill", "requests": R, "tokens": T}``: R requests of T distinct tokens are
  scheduled (``Scheduler.schedule``) and finished; their full blocks stay cached (ref 0);
* ``{"op": "evict_then_prefill", "pages": P, ...}``: the eviction hook is asked for P pages (as
  the governor asks it), then a prefill runs: its ``schedule()`` runs the queued eviction;
* ``{"op": "status"}``: the pool governor's status, the board, the eviction hook, the pool;
* ``{"op": "exit"}``.

``KVB_TEST_REGISTER_WAIT_S`` shortens how long EngineCore waits for its workers to register
before it governs with those that did (a worker then registers late).
"""

from __future__ import annotations

import functools
import itertools
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

BLOCK_TOKENS = kv_model.BLOCK_TOKENS

reply = line_replies.open_channel()


class ModelConfig:
    """The model facts vLLM's scheduler reads (a CPU VllmConfig has no model)."""

    max_model_len = 4096
    is_encoder_decoder = False
    skip_tokenizer_init = True
    runner_type = "generate"

    def __getattr__(self, name):
        return None


class Config:
    def __init__(self, vc):
        self._vc = vc
        self.model_config = ModelConfig()

    def __getattr__(self, name):
        return getattr(self._vc, name)


def build_engine(world_size: int):
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCoreProc, EngineShutdownState

    from kvcached.integration.vllm import interfaces as kvi

    vc = VllmConfig(device_config=DeviceConfig(device="cpu"))
    vc.scheduler_config.async_scheduling = False
    vc.scheduler_config.max_num_batched_tokens = 1 << 16  # a prefill of many requests in one step
    vc.scheduler_config.max_num_seqs = 256
    vc.cache_config.enable_prefix_caching = True
    kv_cfg, _ = kv_model.kv_cache_config(vc)
    vc.cache_config.num_gpu_blocks = kv_cfg.num_blocks
    # what kvcached's patched EngineCore.__init__ does first
    kvi.init_kvcached(tp_rank=0, world_size=world_size, pp_rank=0, is_worker=False, async_sched=False,
                      device="cuda:0")
    if world_size == 1:  # vLLM's UniProcExecutor: the worker runs in EngineCore's process
        kvi.init_kvcached(tp_rank=0, world_size=1, pp_rank=0, is_worker=True, device="cuda:0")
        kv_model.create_worker_tensors(vc)
    scheduler = Scheduler(vllm_config=Config(vc), kv_cache_config=kv_cfg, structured_output_manager=None,
                          block_size=BLOCK_TOKENS, log_stats=False)

    class DriverCore(EngineCoreProc):
        """vLLM's EngineCoreProc loop; a UTILITY request carrying a callable runs it here."""

        def _handle_client_request(self, request_type, request):
            if callable(request):
                return request()
            return super()._handle_client_request(request_type, request)

    import queue

    core = object.__new__(DriverCore)
    core.scheduler = scheduler
    core.input_queue = queue.Queue()
    core.output_queue = queue.Queue()
    core.aborts_queue = queue.Queue()
    core._idle_state_callbacks = []
    core.process_input_queue_block = True
    core.shutdown_state = EngineShutdownState.RUNNING
    core.engines_running = False
    core.batch_queue = None
    core.publish_dp_lb_stats = False  # what the busy loop of later releases reads (0.30)
    core.enable_fault_tolerance = False
    core.check_for_draft_tokens = False

    def step():
        """EngineCore.step without a model: the scheduler steps while it has requests (finished
        ones included, which its next ``schedule()`` clears)."""
        if scheduler.has_requests():
            scheduler.schedule()
        return {}, False

    core.step_fn = step
    core.async_scheduling = False
    core.use_spec_decode = False
    return core


def main(argv: list[str]) -> None:
    usage_dir, total_bytes, world_size = Path(argv[0]), int(argv[1]), int(argv[2])
    from kvcached_broker.tools.kvcached_sim import kvcached_cpu

    kvcached_cpu.install(usage_dir, total_bytes, os.environ["KVCACHED_IPC_NAME"])
    if os.environ.get("KVB_TEST_REGISTER_WAIT_S"):  # how long EngineCore waits for its workers to register
        from kvcached_broker.adapters.kvcached.broadcast import board_grants

        board_grants.REGISTER_WAIT_S = float(os.environ["KVB_TEST_REGISTER_WAIT_S"])
    import kvcached.autopatch  # noqa: F401  (what kvcached's own .pth does)
    import vllm  # noqa: F401  (kvcached's hook patches vLLM here)
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.engine import EngineCoreRequestType
    from vllm.v1.engine.core import EngineShutdownState
    from vllm.v1.request import Request, RequestStatus

    from kvcached_broker.adapters import kvcached as kvmode
    from kvcached_broker.adapters.kvcached import runner
    from kvcached_broker.adapters.vllm import prefix_eviction

    core = build_engine(world_size)
    pool = core.scheduler.kv_cache_manager.block_pool
    manager = pool.kv_cache_manager
    hook = prefix_eviction.attach(core)  # what the adapter's EngineCore.__init__ patch does
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK_TOKENS, hash_fn)
    held: list = []
    ids = itertools.count()

    def status() -> dict:
        governor = manager.page_allocator.governor
        return {"pid": os.getpid(), "pools": kvmode.status(), "board": governor.grants.status()
                if hasattr(governor.grants, "status") else None,
                "limit_pages": manager.page_allocator.get_num_total_pages(),
                "inuse_pages": manager.page_allocator.get_num_inuse_pages(),
                "cached_blocks": len(pool._evictable_blocks), "held_blocks": len(held),
                "evicted_blocks": hook.evicted_blocks if hook else 0,
                "eviction": {"thread": hook.last_thread, "ran_in": hook.last_run, "runs": hook.runs} if hook else None,
                "free_blocks": pool.get_num_free_blocks(), "post_init": manager._post_init_done.is_set()}

    def alloc(blocks: int) -> dict:
        from kvcached.integration.vllm.patches import KVCachePoolExhausted

        try:
            got = pool.get_new_blocks(blocks)
        except KVCachePoolExhausted:
            return {"got": None}
        held.extend(got)
        return {"got": len(got)}

    def fill(blocks: int, misses: int) -> dict:
        """Allocate in batches of a page until ``blocks`` more are held, as a scheduler steps:
        after a miss, the next try waits for one governor round; gives up after ``misses``."""
        start, missed = len(held), 0
        while len(held) - start < blocks and missed < misses:
            if alloc(min(kv_model.blocks_per_page(), blocks - (len(held) - start)))["got"] is None:
                missed += 1
                runner.settle(1)
        return {"got": len(held) - start, "misses": missed}

    def free(blocks: int) -> dict:
        taken = held[-blocks:] if blocks else []
        del held[len(held) - len(taken):]
        pool.free_blocks(taken)
        return {"held_blocks": len(held)}

    def prefill(requests: int, tokens: int, misses: int = 1000) -> dict:
        """Schedule ``requests`` new prefills until all were scheduled, a governor round after each
        step that could not; gives up after ``misses`` rounds in a row in which nothing moved (no
        request scheduled, no page granted to the pool or added to kvcached's size).  The grant
        grows only as the TP workers' processes take it from their brokers, so a round of this
        process alone, on a loaded machine, often finds nothing new yet."""
        made = []
        for _ in range(requests):
            n = next(ids)
            req = Request(request_id=f"r{n}", prompt_token_ids=list(range(n * 100000, n * 100000 + tokens)),
                          sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                          block_hasher=hasher)
            core.scheduler.add_request(req)
            made.append(req.request_id)
        scheduled: set[str] = set()
        governor = manager.page_allocator.governor
        moved, idle = None, 0
        while idle < misses:  # the scheduler steps until every prefill was scheduled (a miss waits)
            scheduled.update(core.scheduler.schedule().num_scheduled_tokens)
            if scheduled >= set(made):
                break
            runner.settle(1)  # a step that could not schedule everything: the next one, after the governor ran
            now = (len(scheduled), manager.page_allocator.get_num_total_pages(),
                   governor.grants.pages if governor.grants is not None else -1)
            moved, idle = now, 0 if now != moved else idle + 1
        core.scheduler.finish_requests(made, RequestStatus.FINISHED_STOPPED)
        return {"scheduled": len(scheduled), "cached_blocks": len(pool._evictable_blocks)}

    def run(request: dict) -> None:
        op = request["op"]
        if op == "alloc":
            reply(alloc(request["blocks"]))
        elif op == "fill":
            reply(fill(request["blocks"], request.get("misses", 100)))
        elif op == "free":
            reply(free(request["blocks"]))
        elif op == "prefill":
            reply(prefill(request["requests"], request["tokens"]))
        elif op == "status":
            reply(status())
        elif op == "evict_then_prefill":  # the governor's ask arrives, then the scheduler's next step
            hook.evict(request["pages"])
            reply(prefill(request["requests"], request["tokens"]))
        elif op == "settle":
            reply({"settled": runner.settle()})
        elif op == "exit":
            core.shutdown_state = EngineShutdownState.SHUTTING_DOWN
            reply({"bye": True})

    def read_requests() -> None:
        for line in sys.stdin:
            core.input_queue.put((EngineCoreRequestType.UTILITY, functools.partial(run, json.loads(line))))
        core.input_queue.put((EngineCoreRequestType.UTILITY, functools.partial(run, {"op": "exit"})))

    manager._post_init_done.wait(60)
    reply({"ready": True, **status()})
    threading.Thread(target=read_requests, daemon=True).start()
    threading.current_thread().name = "engine-core"
    try:
        core.run_busy_loop()
    except SystemExit:
        pass


if __name__ == "__main__":
    main(sys.argv[1:])
