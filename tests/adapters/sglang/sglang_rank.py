"""One SGLang TP rank in kvcached mode on a CPU, driven over stdin: one JSON line in, one out.

    python sglang_rank.py USAGE_DIR TOTAL_BYTES IPC_NAME --rank R --world W --init FILE [--direct]

``IPC_NAME`` ``-``: kvcached's default (``kvcached_SGLang_<process group>``), which the ranks of one
process group share.

What runs is what an SGLang scheduler process runs with ``ENABLE_KVCACHED=1``: the broker's
``.pth`` hook (at interpreter start) and kvcached's autopatch (imported first, as kvcached's own
``.pth`` does) patch SGLang 0.5.23's real modules; the pool is kvcached's real
``ElasticMHATokenToKVPool`` (SGLang's ``memory_pool.MHATokenToKVPool``, aliased by kvcached) with
kvcached's elastic allocator, built on ``cuda:0`` of a simulated GPU (only ``kvcached.vmm_ops``
is a double, ``kvcached_cpu``; small tensors live on the CPU, ``cuda_on_cpu``); the prefix cache
is SGLang's ``RadixCache``; requests are allocated through SGLang's ``mem_cache/allocation.py``
after an admission check on ``available_size() + evictable_size()`` as its prefill budget
does; each scheduler iteration is the real, patched ``Scheduler.ingest_requests`` (request
intake stubbed: there is no tokenizer).  The ranks of a TP group are joined by a gloo process
group, published as SGLang's TP and world groups.  ``KVCACHED_BROKER`` names this rank's broker
(``off``: none).

Requests (``op``): ``profile`` (SGLang's real ``_profile_available_bytes``), ``build``, ``step``
(``n`` iterations, or until the agreed limit of pool 0 is at most ``limit_at_most`` / at least
``limit_at_least``), ``admit`` / ``alloc_admitted`` / ``allocate`` (admission, then SGLang's
allocation; a ``RuntimeError`` from it is reported, never raised), ``finish`` (requests end, their
tokens stay in the radix cache), ``free``, ``wait_want`` (the governor asked for a lower limit),
``status``, ``want_raise`` / ``pressure_inside_next_collective`` / ``race_result`` (pressure
while the scheduler is inside a sync point's collective), ``break_before_sync``,
``build_dsv4``, ``charge``, ``exit``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from array import array
from pathlib import Path

HERE = Path(__file__).resolve().parent
HEADS, HEAD_DIM, LAYERS, PAGE_TOKENS = 8, 128, 4, 16
POOL_TOKENS = 56 * 1024  # 56 pool pages of 1024 tokens: 896 MiB of the 1 GiB virtual range


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("usage", type=Path)
    parser.add_argument("total", type=int)
    parser.add_argument("ipc")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--init", default="")
    parser.add_argument("--weights", type=int, default=0, help="bytes torch has reserved (the weights)")
    parser.add_argument("--direct", action="store_true", help="limits applied at once (no sync points)")
    return parser.parse_args(argv)


def reply(obj: dict) -> None:
    """Replaced by :func:`main` with this process's reply channel (``line_replies``)."""
    raise RuntimeError("no reply channel: run as a script")


class Rank:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.pool = self.allocator = self.tree = self.scheduler = None
        self.running: list = []  # (token ids tensor, key) of requests holding KV
        self.admitted = 0
        self.next_token = 1
        self.errors: list[str] = []
        self.sync_log: list[dict] = []
        self.dsv4 = None
        self.dsv4_allocators: tuple = ()
        self.race: dict = {}

    # ------------------------------------------------------------ start-up
    def profile(self, free_bytes: int, pre_model_load_bytes: int) -> dict:
        """SGLang's real ``_profile_available_bytes`` with kvcached's capacity patch beneath the
        broker's; returns the figure and the broker's holds on this rank."""
        import sglang_cpu
        from kvcached_broker.adapters.sglang import kv_sizing, reporting
        from kvcached_broker.adapters.sglang import parallel

        obj = sglang_cpu.profiler(free_bytes, real_world_group=True)
        obj.device = "cuda:0"
        figure = sglang_cpu.run_profile(obj, pre_model_load_bytes)
        decision = kv_sizing.last_decision()
        return {"kv_bytes": figure, "held_bytes": reporting.held_bytes(parallel.identity("cuda:0")),
                "ever_bytes": decision.sized.ever_bytes if decision and decision.sized else None}

    def build(self, tokens: int = POOL_TOKENS) -> dict:
        import torch
        import sglang.srt.mem_cache.kv_cache_configurator as configurator
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.mem_cache import memory_pool
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixCache

        self.pool = memory_pool.MHATokenToKVPool(tokens, PAGE_TOKENS, torch.float16, HEADS, HEAD_DIM, LAYERS,
                                                 "cuda:0", False, enable_alt_stream=False)
        self.allocator = configurator.PagedTokenToKVPoolAllocator(tokens, PAGE_TOKENS, torch.float16, "cuda:0",
                                                                  self.pool, False)
        self.tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None,
                                               token_to_kv_pool_allocator=self.allocator, page_size=PAGE_TOKENS))
        self.scheduler = scheduler_for(Scheduler, self.tree, self.allocator)
        manager = self.pool.kvcached_allocator
        manager._post_init_done.wait(30)
        return {"pool": type(self.pool).__name__, "allocator": type(self.allocator).__name__,
                "allocator_module": type(self.allocator).__module__, **self.status()}

    def start_up(self, weights_bytes: int, mem_fraction_static: float, graphs_bytes: int, warmup_bytes: int) -> dict:
        """A whole scheduler start-up on the shared device, inside the scheduler's start-up method as
        the adapters patch it: the CUDA context, the weights, SGLang's real profile (kvcached's
        capacity patch under the broker's cap, the slack held), kvcached's pool built in the
        virtual size it was given, then CUDA graphs and the warm-up's activations, allocated after
        the pool's first grant (what kvcached mode must still see: they never hide in granted but
        unmapped pages).  Returns ``serving``, ``refused`` (the adapters' start-up error) or
        ``crashed`` (CUDA's out-of-memory error)."""
        import sglang_cpu
        import torch

        from kvcached_broker.adapters.sglang import kv_budget, startup
        from kvcached_broker.tools.shared_gpu import DeviceFull, Footprint

        memory = self.memory = Footprint(self.gpu)
        cell_bytes = HEADS * HEAD_DIM * torch.float16.itemsize * 2 * LAYERS

        def init_model_worker(scheduler) -> None:
            pre_model_load_bytes = self.gpu.free_bytes()
            memory.allocate("weights", weights_bytes)
            torch.cuda.memory_reserved = lambda device=None: memory.held_bytes()
            obj = sglang_cpu.profiler(self.gpu.free_bytes(), real_world_group=True)
            obj.device = "cuda:0"
            with sglang_cpu.runtime_config(mem_fraction_static=mem_fraction_static):
                virtual_bytes = obj._profile_available_bytes(pre_model_load_bytes / (1 << 30))
            self.build(tokens=max(PAGE_TOKENS, virtual_bytes // cell_bytes // 1024 * 1024))
            self.charge()
            memory.allocate("cuda_graphs", graphs_bytes)
            memory.allocate("activations", warmup_bytes)

        try:
            memory.touch()
            startup.wrap_init_model_worker(init_model_worker)(None)
        except kv_budget.BrokerBudgetError as exc:
            return {"event": "refused", "error": str(exc), "footprint": memory.parts}
        except DeviceFull as exc:
            return {"event": "crashed", "error": str(exc), "footprint": memory.parts}
        return {"event": "serving", "footprint": memory.parts, **self.status()}

    def batch(self, activations_bytes: int) -> dict:
        """A later prefill's activations, inside the slack the runtime kept."""
        from kvcached_broker.tools.shared_gpu import DeviceFull

        try:
            self.memory.allocate("activations", activations_bytes)
        except DeviceFull as exc:
            return {"event": "crashed", "error": str(exc), "footprint": self.memory.parts}
        return {"event": "batched", "footprint": self.memory.parts}

    # ------------------------------------------------------------ the scheduler
    def step(self, n: int = 1, limit_at_most: int | None = None, limit_at_least: int | None = None,
             max_steps: int = 20000) -> dict:
        """Scheduler iterations: ``n``, or until the agreed limit of pool 0 crosses a bound (every
        rank sees the same agreed limit, so every rank stops at the same iteration)."""
        import time

        from sglang.srt.managers.scheduler import Scheduler

        bounded = limit_at_most is not None or limit_at_least is not None
        steps = 0
        while steps < (max_steps if bounded else n):
            Scheduler.ingest_requests(self.scheduler)
            steps += 1
            record = self.last_record()
            if record is not None:
                self.sync_log.append(record)
            if bounded and record is not None and _reached(record["agreed_pages"][0], limit_at_most, limit_at_least):
                break
            time.sleep(0.002)  # the iteration's forward pass; lets the governors' thread run
        return {"steps": steps, "record": self.last_record()}

    def records(self) -> dict:
        """Every sync point this rank saw in ``step`` (to compare with its peers')."""
        return {"records": self.sync_log}

    def last_record(self) -> dict | None:
        from kvcached_broker.adapters.kvcached import agreement

        last = agreement.shared().last
        if last is None:
            return None
        return {"number": last.number, "agreed_pages": last.agreed_pages, "evicted_pages": last.evicted_pages,
                "limit_pages": last.limit_pages}

    # ------------------------------------------------------------ requests
    def admit(self, tokens: int) -> dict:
        """SGLang's prefill admission: the request fits in what is free plus what is evictable."""
        room = self.allocator.available_size() + self.tree.evictable_size()
        self.admitted = tokens if tokens <= room else 0
        return {"admitted": bool(self.admitted), "room_tokens": room}

    def alloc_admitted(self) -> dict:
        """Allocate the admitted request through SGLang's own allocation function."""
        import torch
        from sglang.srt.mem_cache.allocation import alloc_paged_token_slots_extend

        tokens, self.admitted = self.admitted, 0
        if not tokens:
            return {"allocated": False}
        zeros = torch.zeros(1, dtype=torch.int64)
        seq = torch.tensor([tokens], dtype=torch.int64)
        try:
            loc = alloc_paged_token_slots_extend(self.tree, zeros, zeros, seq, seq, torch.full((1,), -1), tokens)
        except RuntimeError as exc:
            self.errors.append(str(exc).splitlines()[0])
            return {"allocated": False, "runtime_error": self.errors[-1]}
        self.running.append(loc)
        return {"allocated": True}

    def allocate(self, requests: int, tokens: int) -> dict:
        """``requests`` requests of ``tokens`` each, admitted one by one (a miss stops)."""
        done = 0
        for _ in range(requests):
            if not self.admit(tokens)["admitted"]:
                break
            result = self.alloc_admitted()
            if not result["allocated"]:
                break
            done += 1
        return {"allocated": done, "errors": self.errors, **self.status()}

    def finish(self, requests: int) -> dict:
        """The oldest ``requests`` end; their tokens stay in the radix cache (evictable)."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        for _ in range(min(requests, len(self.running))):
            loc = self.running.pop(0)
            ids = array("q", range(self.next_token, self.next_token + len(loc)))
            self.next_token += len(loc)
            self.tree.insert(InsertParams(key=RadixKey(ids), value=loc))
        return self.status()

    def free(self, requests: int) -> dict:
        for _ in range(min(requests, len(self.running))):
            self.allocator.free(self.running.pop())
        return self.status()

    def wait_want(self, timeout_s: float = 60.0) -> dict:
        """Wait until this rank's governor asked for a lower limit: an agreed want waiting for
        the next sync point, or (``--direct``) kvcached's limit actually lowered."""
        import time

        from kvcached_broker.adapters.kvcached import agreement

        manager = self.pool.kvcached_allocator
        before = manager.page_allocator.get_num_total_pages()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.args.direct and manager.page_allocator.get_num_total_pages() < before:
                return {"wanted": True, **self.status()}
            if not self.args.direct and agreement.shared().pending_wants() > 0:
                return {"wanted": True, **self.status()}
            time.sleep(0.005)
        return {"wanted": False, **self.status()}

    # ------------------------------------------------------------ races at a sync point
    def want_raise(self, timeout_s: float = 60.0) -> dict:
        """Wait until this rank's governor wants a limit above kvcached's size (a raise waiting
        for the next sync point), then until its thread is free again: no iteration runs
        meanwhile, so its bounded wait for the sync times out and the raise stays wanted."""
        import time

        from kvcached_broker.adapters.kvcached import agreement, runner

        manager = self.pool.kvcached_allocator
        deadline = time.monotonic() + timeout_s
        while True:
            state = agreement.shared().state_of(manager)
            total = manager.page_allocator.get_num_total_pages()
            if state is not None and (state.wanted_pages or 0) > total and agreement.shared().pending_wants() > 0:
                break
            if time.monotonic() > deadline:
                return {"wanted": False, **self.status()}
            time.sleep(0.005)
        assert runner.settle(2, timeout_s=30.0), "the governors' thread did not come back"
        return {"wanted": True, "wanted_pages": state.wanted_pages, **self.status()}

    def pressure_inside_next_collective(self, pages: int) -> dict:
        """Inside the next collective this rank enters (the sync point's all-reduce, after this
        rank made its offer): the broker's pressure for ``pages`` pool pages reaches this rank's
        governor (as the client's pressure fan-out delivers it), and the all-reduce goes on only
        once the governor acted on it: gave grant back, or waits for the sync to end."""
        import time

        import torch.distributed as dist

        from kvcached_broker.adapters.kvcached import agreement, runner

        manager = self.pool.kvcached_allocator
        governor = manager.page_allocator.governor
        real = dist.all_reduce
        self.race = {}

        def all_reduce(*args, **kwargs):
            dist.all_reduce = real
            state = agreement.shared().state_of(manager)
            released, waits = governor.counters["pages_released"], getattr(state, "release_waits", 0)
            self.race["granted_before"] = governor.grants.pages
            governor.ask_back(pages)
            runner.wake()
            deadline = time.monotonic() + 30.0
            while (governor.counters["pages_released"] == released and getattr(state, "release_waits", 0) == waits
                   and time.monotonic() < deadline):
                time.sleep(0.001)
            self.race.update(granted_inside=governor.grants.pages, released_inside=governor.counters["pages_released"]
                             - released, waited=getattr(state, "release_waits", 0) - waits)
            return real(*args, **kwargs)

        dist.all_reduce = all_reduce
        return {}

    def race_result(self) -> dict:
        return self.race

    def break_before_sync(self) -> dict:
        """What runs before the collective fails on this rank from now on: the radix cache
        (asked whether it shares prefixes) and SGLang's parallel state (asked for the group)."""
        from kvcached_broker.adapters.sglang import parallel

        def broken(*args, **kwargs):
            raise RuntimeError("broken on purpose")

        self.tree.supports_prefix_sharing = broken
        parallel.scheduling_group = broken
        return {}

    # ------------------------------------------------------------ DeepSeek-V4
    def build_dsv4(self) -> dict:
        """A DeepSeek-V4 pool and the allocators SGLang builds for it, with kvcached mode on."""
        import sglang_cpu
        import torch
        import sglang.srt.mem_cache.allocator.swa as swa
        import sglang.srt.mem_cache.kv_cache_configurator as configurator

        pool = sglang_cpu.build_dsv4_pool(8, 2)
        self.dsv4 = pool
        with sglang_cpu.runtime_config():
            swa_alloc = swa.SWATokenToKVPoolAllocator(8 * 256, 2 * 256, 256, torch.float8_e4m3fn, "cpu", pool, False)
            paged = configurator.PagedTokenToKVPoolAllocator(8 * 256, page_size=256, dtype=torch.float8_e4m3fn,
                                                             device="cpu", kvcache=pool, need_sort=False)
        self.dsv4_allocators = (swa_alloc, paged)
        out = paged.alloc(256)
        return {"swa_sub_allocators": [type(a).__module__ + "." + type(a).__name__
                                       for a in (swa_alloc.full_attn_allocator, swa_alloc.swa_attn_allocator)],
                "paged": type(paged).__module__ + "." + type(paged).__name__, "paged_alloc": out is not None,
                "tensor_pools": sglang_cpu.tensor_bytes_by_pool(pool)}

    def charge(self) -> dict:
        """What SGLang's ``_init_pools`` wrapper does once the pools exist."""
        from kvcached_broker.adapters.sglang import kv_sizing

        for built in (self.dsv4, self.pool):
            if built is not None:
                kv_sizing.charge_pools("cuda:0", 0, built)
        return {}

    def kvcached_reports(self, names: list[str]) -> dict:
        """Make the installed kvcached say it reports these runtime-owned reservations itself
        (the ``runtime_reservation_reporting`` capability a later kvcached has; 0.1.6 does not)."""
        import kvcached.observability as observability

        capabilities = observability.get_capabilities()
        capabilities["features"]["runtime_reservation_reporting"] = True
        observability.get_capabilities = lambda: capabilities
        observability.get_runtime_owned_reservations = lambda: [{"pool_name": name, "num_bytes": 0} for name in names]
        return {}

    def trace_first_grant(self) -> dict:
        """Record this instance's reservations at the broker when a kvcached pool takes its
        first grant (read from the broker itself, at that moment)."""
        from kvcached_broker.adapters.kvcached import grants
        from kvcached_broker.client.admin import AdminClient

        real = grants.SessionGrants.acquire
        seen = self.first_grant_pools = []

        def acquire(grant_self, pages, min_pages, **said):  # ``said``: the Grants call's wait_s
            if not seen:
                with AdminClient(os.environ["KVCACHED_BROKER"], timeout_s=5.0) as admin:
                    (mine,) = [i for i in admin.status()["instances"] if i["name"] == os.environ["KVCACHED_BROKER_INSTANCE"]]
                seen.append(mine["pools"])
            return real(grant_self, pages, min_pages, **said)

        grants.SessionGrants.acquire = acquire
        return {}

    def first_grant(self) -> dict:
        return {"pools": self.first_grant_pools[0] if self.first_grant_pools else None}

    # ------------------------------------------------------------ status
    def status(self) -> dict:
        from kvcached_broker.adapters import kvcached as kvmode

        out = {"errors": self.errors, "running": len(self.running), "pools": kvmode.status()}
        if self.pool is not None:
            manager = self.pool.kvcached_allocator
            out.update(available_tokens=self.allocator.available_size(), evictable_tokens=self.tree.evictable_size(),
                       limit_pages=manager.page_allocator.get_num_total_pages(),
                       inuse_pages=manager.page_allocator.get_num_inuse_pages(), limit=manager.memory_limit_state())
        return out


def _reached(pages: int, at_most: int | None, at_least: int | None) -> bool:
    return (at_most is not None and pages <= at_most) or (at_least is not None and pages >= at_least)


def scheduler_for(scheduler_class: type, tree: object, allocator: object) -> object:
    """A ``Scheduler`` with what ``ingest_requests`` reads: no requests arrive (no tokenizer)."""
    scheduler = object.__new__(scheduler_class)
    scheduler._deferred_input_requests = []
    scheduler._poll_timeout_aborts = lambda: []
    scheduler.request_receiver = types.SimpleNamespace(recv_requests=lambda local_reqs=None: [])
    scheduler.process_input_requests = lambda recv_reqs: None
    scheduler.tree_cache = tree
    scheduler.token_to_kv_pool_allocator = allocator
    return scheduler


def publish_groups(rank: int, world: int) -> None:
    """The gloo group as SGLang's TP, attention-TP and world groups (one pipeline stage)."""
    import torch.distributed as dist
    from sglang.srt.runtime_context import get_parallel

    group = types.SimpleNamespace(rank_in_group=rank, world_size=world, cpu_group=dist.group.WORLD,
                                  ranks=list(range(world)))
    stage = types.SimpleNamespace(rank_in_group=0, world_size=1, cpu_group=None, ranks=[rank])
    get_parallel().override_permanently(tp_group=group, attn_tp_group=group, world_group=group, pp_group=stage,
                                        pp_rank=0, attn_tp_rank=rank, attn_cp_rank=0, attn_dp_enabled=False)


def _log_to_stderr() -> None:
    """The adapters' log (INFO: every grant, limit and eviction) in this rank's log file."""
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(relativeCreated)d %(threadName)s %(name)s %(message)s"))
    logger = logging.getLogger("kvcached_broker")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> None:
    global reply
    args = parse_args(sys.argv[1:] if argv is None else argv)
    sys.path.insert(0, str(HERE.parent))
    import line_replies

    sys.path.remove(str(HERE.parent))  # its vllm/ folder would pass for vLLM (kvcached's engine detection)
    reply = line_replies.open_channel()
    _log_to_stderr()
    sys.path[:0] = [str(HERE), str(HERE.parents[1] / "sglang")]
    from kvcached_broker.tools.kvcached_sim import kvcached_cpu

    gpu = kvcached_cpu.install(args.usage, args.total, args.ipc)
    if args.ipc == "-":  # kvcached's default name: per process group, shared by the server's ranks
        del os.environ["KVCACHED_IPC_NAME"]
    import torch

    torch.cuda.memory_reserved = lambda device=None: args.weights
    import cuda_on_cpu

    cuda_on_cpu.enter()
    import kvcached.autopatch  # noqa: F401  - what kvcached's own .pth does at interpreter start

    from kvcached_broker.adapters import autopatch

    assert autopatch.hook_installed(), "the broker's .pth hook did not run (ENABLE_KVCACHED=1?)"
    import torch.distributed as dist

    import datetime

    # A collective a peer never joins fails after a minute instead of hanging the test.
    dist.init_process_group("gloo", init_method=f"file://{args.init}", rank=args.rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=60))
    import sglang  # kvcached's patches apply now (wrapt hook on sglang)
    import sglang.srt.managers.scheduler  # the sync-point patch
    import sglang.srt.mem_cache.kv_cache_configurator  # noqa: F401  - kvcached's sizing patch, then the broker's

    publish_groups(args.rank, args.world)
    if args.direct:
        from kvcached_broker.adapters.kvcached import limits

        limits.set_factory(None)  # the hazard: limits applied on the governors' thread
    rank = Rank(args)
    rank.gpu = gpu
    from kvcached.utils import DEFAULT_IPC_NAME

    reply({"ready": True, "pid": os.getpid(), "ipc_name": DEFAULT_IPC_NAME})
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        if op == "exit":
            reply({"bye": True})
            break
        try:
            reply(getattr(rank, op)(**request))
        except Exception as exc:  # noqa: BLE001 - report to the test, which fails on it
            import traceback

            reply({"exception": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
    os._exit(0)  # no collective at exit: the peer may be gone


if __name__ == "__main__":
    main()
