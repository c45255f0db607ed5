"""A serving process with one real kvcached ``KVCacheManager``, driven by the tests over stdin.

    pool_worker.py USAGE_DIR TOTAL_BYTES IPC_NAME ENDPOINT

It does what an SGLang rank does with kvcached mode on: the broker adapter's kvcached patch
is applied, then kvcached's own SGLang integration builds the pool (``init_kvcached``,
``get_kv_cache_manager``, ``alloc_kv_cache``) on the shared simulated GPU (only
``kvcached.vmm_ops`` is a double).  Requests are JSON lines; each gets one JSON line back:

* ``{"op": "fill", "blocks": N}``: allocate until N blocks are held, as an engine does (a
  refused allocation is a scheduling miss; it retries after the governors' thread ran);
  ``{"op": "free", "blocks": N}``: free the N newest; ``{"op": "cache", "blocks": N}``: the
  N newest finish but stay in the prefix cache (held until the eviction hook frees them);
* ``{"op": "status"}``: the governor's status, kvcached's limit state and the bytes this
  process has on the device; ``{"op": "settle"}``: wait for two governor rounds.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers

import kvcached_cpu  # noqa: E402

NUM_LAYERS = 4
HEADS, HEAD_DIM = 8, 128
BLOCK_TOKENS = 16


def main() -> None:
    usage_dir, total_bytes, ipc_name, endpoint = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    gpu = kvcached_cpu.install(Path(usage_dir), total_bytes, ipc_name)
    import torch

    from helpers import connect_to
    from kvcached_broker.adapters import autopatch, worker
    from kvcached_broker.adapters import kvcached as kvmode
    from kvcached_broker.adapters.kvcached import runner

    worker.client_factory = connect_to(endpoint)
    autopatch.apply(["kvcached"])
    from kvcached.integration.sglang import interfaces

    interfaces.init_kvcached(device="cuda:0")
    cell_bytes = HEADS * HEAD_DIM * torch.float16.itemsize
    num_tokens = 1 << 22
    manager = interfaces.get_kv_cache_manager(num_tokens // BLOCK_TOKENS, BLOCK_TOKENS, cell_bytes, NUM_LAYERS,
                                              pool_name="mha")
    interfaces.alloc_kv_cache((num_tokens, HEADS, HEAD_DIM), torch.float16, "cuda:0", NUM_LAYERS,
                              page_size=BLOCK_TOKENS)
    engine = Engine(manager, runner)
    kvmode.register_eviction_hook(manager, engine)
    manager._post_init_done.wait(30)
    reply({"ready": True, **engine.status(gpu)})
    for line in sys.stdin:
        request = json.loads(line)
        op = request["op"]
        if op == "fill":
            reply(engine.fill(request["blocks"], request.get("timeout_s", 30.0)))
        elif op == "free":
            reply(engine.free(request["blocks"]))
        elif op == "cache":
            reply(engine.cache(request["blocks"]))
        elif op == "settle":
            reply({"settled": runner.settle()})
        elif op == "status":
            reply(engine.status(gpu))
        elif op == "exit":
            manager.shutdown()
            reply({"bye": True})
            return


class Engine:
    """The engine's side: held blocks, a prefix cache of finished ones, and the eviction hook."""

    def __init__(self, manager, runner):
        self.manager = manager
        self.runner = runner
        self.held: list[list[int]] = []  # one entry per allocation, newest last
        self.cached: list[list[int]] = []
        self.lock = threading.Lock()
        self.misses = 0

    def fill(self, blocks: int, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while self.count() < blocks and time.monotonic() < deadline:
            got = self.manager.alloc(min(64, blocks - self.count()))
            if got is None:
                self.misses += 1
                self.runner.settle(1)  # a scheduling miss: try again once the governor has run
                continue
            with self.lock:
                self.held.append(got)
        return {"held_blocks": self.count(), "misses": self.misses}

    def free(self, blocks: int) -> dict:
        freed = self._take(self.held, blocks)
        if freed:
            self.manager.free(freed)
        return {"held_blocks": self.count()}

    def cache(self, blocks: int) -> dict:
        with self.lock:
            moved = self._take(self.held, blocks)
            self.cached.append(moved)
        return {"held_blocks": self.count(), "cached_blocks": sum(map(len, self.cached))}

    def evict(self, pages: int) -> int:
        """The prefix cache's hook: free every cached block (no running request uses them)."""
        with self.lock:
            blocks = [b for group in self.cached for b in group]
            self.cached = []
        if blocks:
            self.manager.free(blocks)
        return len(blocks)

    def _take(self, source: list[list[int]], blocks: int) -> list[int]:
        taken: list[int] = []
        while source and len(taken) < blocks:
            group = source.pop()
            keep = len(taken) + len(group) - blocks
            if keep > 0:
                source.append(group[:keep])
                group = group[keep:]
            taken.extend(group)
        return taken

    def count(self) -> int:
        with self.lock:
            return sum(map(len, self.held))

    def status(self, gpu) -> dict:
        from kvcached_broker.adapters import kvcached as kvmode

        pools = kvmode.status()
        return {"pid": __import__("os").getpid(), "device_bytes": gpu.mine_bytes(), "pools": pools,
                "limit": self.manager.memory_limit_state(), "held_blocks": self.count(),
                "cached_blocks": sum(map(len, self.cached)), "page_state": self.manager.page_allocator.get_page_state()}


def reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
