"""Governed kvcached pools in the test process: kvcached 0.1.6's real ``KVCacheManager`` with the
broker's patch applied (and undone after the test), an in-process broker, and this process's
real adapter session.

For governor-level checks that need to reach inside the pool (its lock, its allocator, its
governor) or to arrange a failure at a precise point; the process tests (``kv_harness``)
check the invariant from outside with a sampler.
"""

from __future__ import annotations

import threading
import uuid

from helpers import GIB, connect_to

NUM_LAYERS, BLOCK_TOKENS, CELL_BYTES = 4, 16, 8 * 128 * 2
BLOCKS_PER_PAGE = 64  # 16 tokens x 8 heads x 128 x fp16 = 32 KiB per block per layer K; 2 MiB pages
POOL_PAGE_BYTES = (2 << 20) * NUM_LAYERS * 2
SESSION_PAGES_PER_POOL_PAGE = 8
INSTANCE = "model-a"


class InprocPools:
    """The patched kvcached, its simulated GPU, the broker and the pools a test made."""

    def __init__(self, gpu, broker, interfaces, identity_of):
        self.gpu = gpu
        self.broker = broker
        self.interfaces = interfaces
        self.identity_of = identity_of
        self.managers: list = []

    def make(self, num_blocks: int = 1 << 17, *, wait: bool = True):
        """A pool as SGLang's kvcached integration builds one (``get_kv_cache_manager``, then its
        tensors); ``wait``: until kvcached's post-init (the null block) finished."""
        import torch

        self.interfaces.init_kvcached(device="cuda:0")
        manager = self.interfaces.get_kv_cache_manager(num_blocks, BLOCK_TOKENS, CELL_BYTES, NUM_LAYERS,
                                                       pool_name="mha")
        self.managers.append(manager)
        self.interfaces.alloc_kv_cache((num_blocks * BLOCK_TOKENS, 8, 128), torch.float16, "cuda:0", NUM_LAYERS,
                                       page_size=BLOCK_TOKENS)
        if wait:
            assert manager._post_init_done.wait(30)
        return manager

    def client(self):
        from kvcached_broker.adapters import sessions

        session = sessions.session(self.identity_of())
        return session.client if session is not None else None

    def granted_pool_pages(self) -> int:
        """What the broker charges this process's session, in pool pages."""
        session = self.session_status()
        return 0 if session is None else session["granted_pages"] // SESSION_PAGES_PER_POOL_PAGE

    def session_status(self) -> dict | None:
        sessions = [s for inst in self.broker.status()["instances"] if inst["name"] == INSTANCE
                    for s in inst["sessions"]]
        return sessions[0] if sessions else None

    def admin(self):
        return self.broker.admin()

    def close(self) -> None:
        from kvcached_broker.adapters.kvcached import runner
        from kvcached_broker.adapters.kvcached.governor import PoolGovernor
        from kvcached_broker.adapters.kvcached.pool_state import Phase

        for manager in self.managers:
            manager.shutdown()
        runner.settle()
        for governor in runner.governors():  # nothing of this test may reach the next one's broker
            if isinstance(governor, PoolGovernor):
                governor.state.close()  # done, with no broker call: its grant went with the test's broker
                if governor.state.phase is Phase.CLOSING:
                    governor.state.forget()


def governor_of(manager):
    return manager.page_allocator.governor


def inproc_pools(short_tmp, monkeypatch, inproc_factory):
    """The fixture's body (tests/adapters/kvcached/conftest.py)."""
    from kvcached_broker.tools.kvcached_sim import kvcached_cpu

    gpu = kvcached_cpu.install(short_tmp / "gpu-usage", 2 * GIB, f"kvb-inproc-{uuid.uuid4().hex[:10]}",
                               setattr_=monkeypatch.setattr)
    import kvcached.kv_cache_manager as kvm
    from kvcached.integration.sglang import interfaces

    from kvcached_broker.adapters import process_state, sessions
    from kvcached_broker.adapters.kvcached import identity, limits, patches
    from kvcached_broker.adapters.worker_identity import WorkerIdentity

    cls = kvm.KVCacheManager
    for name in ("__init__", "shutdown", "set_memory_limit"):
        monkeypatch.setattr(cls, name, vars(cls)[name])  # undone after the test
    monkeypatch.setattr(kvm, "PageAllocator", kvm.PageAllocator)
    patches.patch_kv_cache_manager(kvm)
    monkeypatch.setenv("KVCACHED_BROKER_TIMEOUT_S", "1")
    monkeypatch.delenv("KVCACHED_REQUIRE", raising=False)
    broker = inproc_factory(total_bytes=2 * GIB)
    process_state.reset()
    sessions.set_client_factory(connect_to(broker.endpoint))

    def identity_of(geometry=None):
        return WorkerIdentity("sglang", 0, instance=INSTANCE)

    identity.set_resolver(identity_of)
    pools = InprocPools(gpu, broker, interfaces, identity_of)
    try:
        yield pools
    finally:
        pools.close()
        interfaces.shutdown_kvcached()
        identity.set_resolver(None)
        limits.set_factory(None)
        process_state.reset()


class Pause:
    """Stops one thread at a point inside a kvcached call until released (``hook`` wraps the
    function called at that point; other threads pass through)."""

    def __init__(self, thread_name: str):
        self.thread_name = thread_name
        self.inside = threading.Event()
        self.go = threading.Event()

    def hook(self, real):
        def paused(*args, **kwargs):
            if threading.current_thread().name == self.thread_name and not self.go.is_set():
                self.inside.set()
                self.go.wait(60)
            return real(*args, **kwargs)

        return paused
