"""A serving process with one real kvcached ``KVCacheManager``, driven over stdin.

    python -m kvcached_broker.tools.kvcached_sim.pool_process USAGE_DIR TOTAL_BYTES IPC_NAME ENDPOINT
        [--layers 4] [--virtual-tokens 4194304] [--evict all|oldest] [--weights-bytes N]

It does what an SGLang rank does with kvcached mode on: the broker adapter's kvcached patch
is applied (by the ``.pth`` hook when ``ENABLE_KVCACHED=1`` is in its environment, as on a
server; explicitly otherwise), then kvcached's own SGLang integration builds the pool (``init_kvcached``,
``get_kv_cache_manager``, ``alloc_kv_cache``) on the shared simulated GPU (only
``kvcached.vmm_ops`` is a double, :mod:`.kvcached_cpu`).  With ``KVCACHED_BROKER=off`` in its
environment the pool runs as kvcached alone.  The model has ``--layers`` layers of 8 KV heads of
128 fp16 values and 16-token blocks, so a pool page is 2 MiB x layers x K and V (16 MiB at 4
layers, 128 MiB at 32).  Requests are JSON lines; each gets one JSON line back:

* ``{"op": "fill", "blocks": N}``: allocate until N blocks are held, as an engine does: it
  allocates only what ``available_size()`` says fits (SGLang's admission, vLLM's free-block
  check), and an allocation that does not fit, or that kvcached refuses all the same, is a
  scheduling miss, tried again at the next scheduler step; with
  ``"reuse_cache": true`` a miss first frees the pool's own prefix cache, as a runtime's does;
  ``"stall_s": S`` gives up once nothing was allocated for S seconds.  The reply times the
  fill (``elapsed_s``, and ``first_miss_s``/``first_refusal_s``: the first allocation that
  missed and the first broker ask that did not fit at once, refused or waiting for memory,
  from the fill's start), gives its start,
  first refusal and end on this machine's monotonic clock (``started_at``, ``refused_at``,
  ``done_at``), and what the calls below took from the first refusal on (``after_refusal``);
  ``{"op": "free", "blocks": N}``: free the N newest; ``{"op": "cache", "blocks": N}``: the
  N newest finish but stay in the prefix cache (held until an eviction frees them);
  ``{"op": "drop_cache"}``: free every cached block;
* ``{"op": "limit", "bytes": N}``: kvcached's own ``set_memory_limit`` (static partitioning);
  ``{"op": "give", "blocks": N, "page_bytes": P}``: free the N oldest cached blocks, trim
  kvcached's reserve and lower the limit to the pages still in use (again until kvcached
  applies it), which unmaps the pages freed at once (the hand-over's oracle,
  ``benchmarks/handover.py``: no broker, no protocol);
* ``{"op": "outside", "bytes": N}``: take N bytes on the device outside the pool, as CUDA graphs
  or cached activations are (``oom`` in the reply if the device has no room);
* ``{"op": "track", "schedule": [[t_s, blocks], ...], "start_at": EPOCH_S, "sample_s": S,
  "gives": [[t_s, blocks, page_bytes], ...]}``: follow a demand trace in real time, and at each
  ``gives`` instant (optional) give as ``give`` does, then lift the limit back (the trace
  oracle's lender; see :meth:`Engine.track`; the reply's ``gave`` has each give's instant,
  blocks freed and the process's device bytes once they were unmapped);
* ``{"op": "status"}``: the governor's status, kvcached's limit state and the bytes this
  process has on the device; ``{"op": "settle"}``: wait for two governor rounds;
* ``{"op": "spans", "start": T0, "end": T1}``: the time this process spent, between two
  instants of the monotonic clock (every process on the machine shares it), in broker round
  trips (``acquire``, ``release``: the governor's asks, whichever thread made them) and in
  kvcached's ``alloc`` and ``free`` (which map and unmap pages when the reserve cannot serve
  them): ``{kind: {"s": seconds, "calls": n}}``.

The prefix cache's eviction hook frees every cached block (``--evict all``) or the oldest ones,
only as many as the broker asked for (``--evict oldest``, an LRU cache).  ``--weights-bytes N``
(the simulated device only): before its pool exists the process touches the GPU (a CUDA
context, torch's first segment) and loads N bytes of weights, as a server does.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path

from msgspec import UNSET

HEADS, HEAD_DIM = 8, 128
BLOCK_TOKENS = 16
#: After a miss the engine tries again at its next scheduling step, this much later (a
#: runtime's scheduler steps every few to tens of milliseconds, whatever the governors do; a hot
#: retry loop would take the CPU from the governors and the broker on a small machine).
RETRY_S = 0.01
#: A give waits at most this long for kvcached to apply the lowered limit (a reserve page the
#: prealloc thread was mapping lands within its map call, a few milliseconds on the simulated
#: device), trying again every GIVE_RETRY_S.
GIVE_SETTLE_S = 1.0
GIVE_RETRY_S = 0.001


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("usage_dir", type=Path)
    parser.add_argument("total_bytes", type=int)
    parser.add_argument("ipc_name")
    parser.add_argument("endpoint")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--virtual-tokens", type=int, default=1 << 22)
    parser.add_argument("--evict", choices=("all", "oldest"), default="all")
    parser.add_argument("--weights-bytes", type=int, default=0)
    return parser.parse_args(argv)


def connect_to(endpoint: str):
    """A ``sessions.set_client_factory`` factory opening the adapter's sessions on ``endpoint`` (no credit reserve)."""
    from ...adapters import sessions

    def factory(identity):
        return sessions.connect(dataclasses.replace(identity, credit_pages=0), endpoint=endpoint)

    return factory


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from ..shared_gpu import Footprint
    from . import kvcached_cpu

    gpu = kvcached_cpu.install(args.usage_dir, args.total_bytes, args.ipc_name)
    if args.weights_bytes > 0:
        memory = Footprint(gpu)
        memory.touch()
        memory.allocate("weights", args.weights_bytes)
    run_pool(args, gpu)


def run_pool(args: argparse.Namespace, gpu) -> None:
    """Build the pool and serve requests until ``exit``, once kvcached's device is in place.

    ``gpu`` answers ``mine_bytes()``: what this process has on the device (the shared simulated
    GPU here; NVML's figure for this process on a real one, ``tools/gpu_check/pool_gpu.py``)."""
    import torch

    from ...adapters import autopatch, sessions
    from ...adapters import kvcached as kvmode
    from ...adapters.kvcached import runner

    sessions.set_client_factory(connect_to(args.endpoint))
    if not autopatch.hook_installed():  # with ENABLE_KVCACHED=1 the .pth hook registered it at start
        autopatch.apply(["kvcached"])
    from kvcached.integration.sglang import interfaces

    interfaces.init_kvcached(device="cuda:0")
    cell_bytes = HEADS * HEAD_DIM * torch.float16.itemsize
    manager = interfaces.get_kv_cache_manager(args.virtual_tokens // BLOCK_TOKENS, BLOCK_TOKENS, cell_bytes,
                                              args.layers, pool_name="mha")
    interfaces.alloc_kv_cache((args.virtual_tokens, HEADS, HEAD_DIM), torch.float16, "cuda:0", args.layers,
                              page_size=BLOCK_TOKENS)
    engine = Engine(manager, gpu, evict_oldest=args.evict == "oldest")
    kvmode.register_eviction_hook(manager, engine)
    engine.time_refusals()
    manager._post_init_done.wait(30)
    reply({"ready": True, **engine.status()})
    serve(engine, manager, runner)


def serve(engine: "Engine", manager, runner) -> None:
    """Answer one JSON line per request line until ``exit`` (or stdin closes)."""
    for line in sys.stdin:
        request = json.loads(line)
        op = request["op"]
        if op == "fill":
            reply(engine.fill(request["blocks"], request.get("timeout_s", 30.0), request.get("reuse_cache", False),
                              request.get("stall_s")))
        elif op == "free":
            reply(engine.free(request["blocks"]))
        elif op == "cache":
            reply(engine.cache(request["blocks"]))
        elif op == "drop_cache":
            reply({"freed_blocks": engine.drop_cache()})
        elif op == "outside":  # memory the process takes outside its pool (CUDA graphs, activations)
            try:
                engine.gpu.allocate(request["bytes"])
                reply({"device_bytes": engine.gpu.mine_bytes()})
            except RuntimeError as exc:
                reply({"oom": str(exc), "device_bytes": engine.gpu.mine_bytes()})
        elif op == "give":
            reply(engine.give(request["blocks"], request["page_bytes"]))
        elif op == "limit":
            reply({"limit": engine.set_limit(request["bytes"])})
        elif op == "track":
            reply(engine.track(request["schedule"], request["start_at"], request.get("sample_s", 0.05),
                               request.get("gives")))
        elif op == "settle":
            reply({"settled": runner.settle()})
        elif op == "status":
            reply(engine.status())
        elif op == "spans":
            reply(engine.spans.totals(request["start"], request["end"]))
        elif op == "exit":
            manager.shutdown()
            reply({"bye": True})
            return


class Engine:
    """The engine's side: held blocks, a prefix cache of finished ones, and the eviction hook."""

    def __init__(self, manager, gpu, *, evict_oldest: bool = False):
        self.manager = manager
        self.gpu = gpu
        self.evict_oldest = evict_oldest
        self.held: list[list[int]] = []  # one entry per allocation, newest last
        self.cached: list[list[int]] = []  # oldest first
        self.lock = threading.Lock()
        self.misses = 0
        self.refusals: list[float] = []  # monotonic times of broker asks that did not fit at once
        self.evicted_blocks = 0
        self.spans = CallSpans()

    # ------------------------------------------------------------ allocation
    def fill(self, blocks: int, timeout_s: float, reuse_cache: bool = False, stall_s: float | None = None) -> dict:
        """Allocate until ``blocks`` are held, ``timeout_s`` passed, or (with ``stall_s``) nothing
        was allocated for ``stall_s``; times the first miss and the first refused broker ask."""
        start = time.monotonic()
        deadline = start + timeout_s
        first_miss = None
        progress = start
        while self.count() < blocks and time.monotonic() < deadline:
            if self.alloc(min(64, blocks - self.count()), reuse_cache):
                progress = time.monotonic()
                continue
            first_miss = time.monotonic() if first_miss is None else first_miss
            if stall_s is not None and time.monotonic() - progress > stall_s:
                break
            self._next_step()
        done = time.monotonic()
        refused = [t for t in self.refusals if t >= start]
        return {"held_blocks": self.count(), "misses": self.misses, "elapsed_s": done - start,
                "first_miss_s": None if first_miss is None else first_miss - start,
                "first_refusal_s": refused[0] - start if refused else None,
                "started_at": start, "refused_at": refused[0] if refused else None, "done_at": done,
                "after_refusal": self.spans.totals(refused[0], done) if refused else None}

    def alloc(self, blocks: int, reuse_cache: bool = False) -> bool:
        """One allocation of ``blocks``, made only if ``available_size()`` says they fit, as a
        runtime admits work (with ``reuse_cache``, the own prefix cache makes room first when they
        do not); a miss otherwise, or when kvcached refuses it all the same."""
        available = self.manager.available_size()
        if reuse_cache and available < blocks and self._free_cached(blocks):
            available = self.manager.available_size()
        got = self.spans.call("alloc", self.manager.alloc, blocks) if available >= blocks else None
        if got is None:
            self.misses += 1
            return False
        with self.lock:
            self.held.append(got)
        return True

    def free(self, blocks: int) -> dict:
        freed = self._take(self.held, blocks)
        if freed:
            self.spans.call("free", self.manager.free, freed)
        return {"held_blocks": self.count()}

    def cache(self, blocks: int) -> dict:
        with self.lock:
            moved = self._take(self.held, blocks)
            if moved:
                self.cached.append(moved)
        return {"held_blocks": self.count(), "cached_blocks": self.cached_count()}

    # ------------------------------------------------------------ the prefix cache
    def evict(self, pages: int) -> int:
        """The eviction hook: free cached blocks (no running request uses them); blocks freed."""
        blocks = pages * self.blocks_per_page() if self.evict_oldest else None
        freed = self._free_cached(blocks)
        self.evicted_blocks += freed
        return freed

    def _free_cached(self, blocks: int | None) -> int:
        """Free the oldest cached blocks, ``blocks`` of them (every one when None)."""
        with self.lock:
            if blocks is None:
                taken = [b for group in self.cached for b in group]
                self.cached = []
            else:
                taken = self._take_oldest(self.cached, blocks)
        if taken:
            self.spans.call("free", self.manager.free, taken)
        return len(taken)

    def set_limit(self, limit_bytes: int) -> dict:
        """kvcached's own ``set_memory_limit``, with the revision after its current one; its
        limit state."""
        revision = int(self.manager.memory_limit_state().get("revision", 0)) + 1
        return self.manager.set_memory_limit(limit_bytes, revision=revision)

    def give(self, blocks: int, page_bytes: int) -> dict:
        """Hand memory back to the device at once, as a pool that knew a neighbour's need would:
        free the ``blocks`` oldest cached blocks, trim kvcached's reserve and lower its limit to
        the pages still in use (``page_bytes`` a page of the pool, every layer), so every page
        freed is unmapped now and the reserve is not mapped again.

        kvcached defers a limit below what is mapped, and its prealloc thread may be mapping
        reserve pages while the limit falls (they land in the reserve after a trim); so the trim
        and the limit are repeated, each limit with a new revision, until kvcached says the limit
        is applied, which it does only once nothing but the pages in use is mapped, or until
        :data:`GIVE_SETTLE_S` has passed (then the state says ``deferred``: ``page_bytes`` below a
        page of every layer sets a limit under the pages in use, which never applies).  A
        quarantined pool's resize raises, as kvcached's does."""
        freed = self._free_cached(blocks)
        limit_bytes = self.manager.page_allocator.get_num_inuse_pages() * page_bytes
        state = self.spans.call("give", self._unmap_down_to, limit_bytes)
        return {"freed_blocks": freed, "limit": state, "device_bytes": self.gpu.mine_bytes()}

    def _unmap_down_to(self, limit_bytes: int) -> dict:
        deadline_s = time.monotonic() + GIVE_SETTLE_S
        while True:
            self.manager.trim()
            state = self.set_limit(limit_bytes)
            if state["status"] == "applied" or time.monotonic() >= deadline_s:
                return state
            time.sleep(GIVE_RETRY_S)

    def give_for_a_while(self, blocks: int, page_bytes: int) -> dict:
        """:meth:`give`, then the limit back where it was: the pages freed are unmapped, and the
        pool may map again later (kvcached maps on demand, not ahead)."""
        capacity_bytes = int(self.manager.memory_limit_state()["current_capacity_bytes"])
        given = self.give(blocks, page_bytes)
        self.set_limit(capacity_bytes)
        return given

    def cached_pages(self) -> int:
        """The hook's idle figure: about how many pool pages the prefix cache could free now."""
        return self.cached_count() // self.blocks_per_page()

    def drop_cache(self) -> int:
        """Free every cached block (a reset between trials); blocks freed."""
        return self._free_cached(None)

    def blocks_per_page(self) -> int:
        return max(1, self.manager.page_size // self.manager.block_mem_size)

    # ------------------------------------------------------------ a demand trace
    def track(self, schedule: list[list[float]], start_at: float, sample_s: float,
              gives: list[list[float]] | None = None) -> dict:
        """Follow ``schedule`` (``[t_s, live blocks wanted]`` steps, from ``start_at``, epoch seconds).

        Every ``sample_s`` the live blocks move toward the demand: up by allocating (a miss is
        retried every scheduler step until the sample ends; the pool's own prefix cache makes
        room first), down by
        finishing requests into the prefix cache.  Each sample records the demand, the live
        blocks and the bytes the process has on the device; ``served_block_s`` integrates
        ``min(demand, live)`` over time and ``demand_block_s`` the demand.

        ``gives`` (``[t_s, blocks, page_bytes]``, a pool without a broker): at the first sample
        at or after ``t_s``, before following the demand, the pool gives its ``blocks`` oldest
        cached blocks back to the device as :meth:`give` does, then its limit is lifted back to
        what it was, so it grows again as kvcached alone does.  ``gave``: per give, ``[t_s,
        blocks freed, device bytes]``, the bytes read once the pages were unmapped and before
        the limit was lifted (kvcached's prealloc thread may map its reserve again after).
        """
        pending, gave = sorted(gives or []), []
        while time.time() < start_at:
            time.sleep(min(0.01, max(0.0, start_at - time.time())))
        end_s = schedule[-1][0]
        samples, served, wanted = [], 0.0, 0.0
        t = 0.0
        while t <= end_s:
            while pending and pending[0][0] <= t:
                _, blocks, page_bytes = pending.pop(0)
                given = self.give_for_a_while(int(blocks), int(page_bytes))
                gave.append([round(t, 3), given["freed_blocks"], given["device_bytes"]])
            demand = demand_at(schedule, t)
            self._follow(demand, deadline=start_at + t + sample_s)
            live = self.count()
            samples.append([round(t, 3), demand, live, self.cached_count(), self.gpu.mine_bytes()])
            served += min(demand, live) * sample_s
            wanted += demand * sample_s
            t = time.time() - start_at
            time.sleep(max(0.0, sample_s - (t - samples[-1][0])))
            t = time.time() - start_at
        return {"samples": samples, "served_block_s": served, "demand_block_s": wanted, "misses": self.misses,
                "evicted_blocks": self.evicted_blocks, "gave": gave}

    def _follow(self, demand: int, deadline: float) -> None:
        live = self.count()
        if live > demand:
            self.cache(live - demand)
            return
        while self.count() < demand and time.time() < deadline:
            if not self.alloc(min(64, demand - self.count()), reuse_cache=True):
                self._next_step()

    def _next_step(self) -> None:
        """A scheduling miss: try again at the next scheduler step (the governors run on their
        own; nothing here waits for them or wakes them)."""
        time.sleep(RETRY_S)

    # ------------------------------------------------------------ bookkeeping
    def time_refusals(self) -> None:
        """Timestamp every refused broker ask, and time every ask and release (instrumentation
        only: the grant is unchanged)."""
        governor = getattr(self.manager.page_allocator, "governor", None)
        grants = getattr(governor, "grants", None)
        if grants is None:
            return
        real_acquire, real_release = grants.acquire, grants.release
        core = getattr(getattr(grants, "client", None), "_core", None)  # its last answer, by identity

        def acquire(*args, **kwargs):
            before = core.last_acquire if core is not None else None
            started = time.monotonic()
            got = self.spans.call("acquire", real_acquire, *args, **kwargs)
            answer = core.last_acquire if core is not None else before
            if got == 0:
                self.refusals.append(time.monotonic())
            elif answer is not before and answer is not None and answer.waited_s is not UNSET:
                self.refusals.append(started)  # it did not fit at once: it waited at the broker
            return got

        def release(*args, **kwargs):
            return self.spans.call("release", real_release, *args, **kwargs)

        grants.acquire = acquire
        grants.release = release

    def _take(self, source: list[list[int]], blocks: int) -> list[int]:
        """The newest ``blocks`` of ``source``."""
        taken: list[int] = []
        while source and len(taken) < blocks:
            group = source.pop()
            keep = len(taken) + len(group) - blocks
            if keep > 0:
                source.append(group[:keep])
                group = group[keep:]
            taken.extend(group)
        return taken

    def _take_oldest(self, source: list[list[int]], blocks: int) -> list[int]:
        taken: list[int] = []
        while source and len(taken) < blocks:
            group = source.pop(0)
            keep = len(taken) + len(group) - blocks
            if keep > 0:
                source.insert(0, group[-keep:])
                group = group[:-keep]
            taken.extend(group)
        return taken

    def count(self) -> int:
        with self.lock:
            return sum(map(len, self.held))

    def cached_count(self) -> int:
        with self.lock:
            return sum(map(len, self.cached))

    def status(self) -> dict:
        from ...adapters import kvcached as kvmode

        return {"pid": os.getpid(), "device_bytes": self.gpu.mine_bytes(), "pools": kvmode.status(),
                "limit": self.manager.memory_limit_state(), "held_blocks": self.count(),
                "cached_blocks": self.cached_count(), "page_state": self.manager.page_allocator.get_page_state(),
                "blocks_per_page": self.blocks_per_page(), "evicted_blocks": self.evicted_blocks,
                "misses": self.misses}


class CallSpans:
    """When this process's timed calls ran: ``(kind, start, end)`` on the monotonic clock.

    Appends come from any thread (a list append is atomic); the oldest spans are dropped past
    :attr:`MAX_SPANS`, so a long run keeps its recent history only."""

    MAX_SPANS = 100_000

    def __init__(self) -> None:
        self._spans: collections.deque[tuple[str, float, float]] = collections.deque(maxlen=self.MAX_SPANS)

    def call(self, kind: str, fn, *args, **kwargs):
        started = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            self._spans.append((kind, started, time.monotonic()))

    def totals(self, start: float, end: float) -> dict[str, dict[str, float]]:
        """Seconds and calls of each kind within ``[start, end]`` (a span counts the part inside)."""
        out: dict[str, dict[str, float]] = {}
        for kind, began, ended in list(self._spans):
            if ended < start or began > end:
                continue
            inside = min(ended, end) - max(began, start)
            entry = out.setdefault(kind, {"s": 0.0, "calls": 0})
            entry["s"] += inside
            entry["calls"] += 1
        return out


def demand_at(schedule: list[list[float]], t_s: float) -> int:
    """The demand in force at ``t_s``: the last step at or before it (0 before the first)."""
    demand = 0
    for at_s, blocks in schedule:
        if at_s > t_s:
            break
        demand = int(blocks)
    return demand


def reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
