"""The governor inside one process: kvcached 0.1.6's real ``KVCacheManager`` (its native extension
replaced by the double), the broker's patch, a real in-process broker (inproc_pool.py).

What these check needs the pool's inside: its lock, its allocator's size and kvctl target, the
revision kvcached keeps, a failure arranged at pool start, the thread a broker request runs on.
"""

from __future__ import annotations

import threading

import pytest
from helpers import GIB, MIB, wait_for
from inproc_pool import BLOCKS_PER_PAGE, INSTANCE, POOL_PAGE_BYTES, Pause, governor_of

from kvcached_broker.adapters.kvcached import runner, segment

pytestmark = pytest.mark.runtime("kvcached")


def _settle() -> None:
    assert runner.settle()


def _session_id(pools) -> str:
    return pools.client().session_id


# ------------------------------------------------------------------ ungoverned: kvcached alone
@pytest.mark.parametrize("cause", ["evicted", "broker_gone"])
def test_an_ungoverned_pool_runs_as_kvcached_alone_without_a_stale_limit(inproc_pools, cause):
    """An eviction, or a broker that stops answering: the limit is lifted to the virtual size, the
    segment shows it, and kvcached's sticky kvctl target (the broker's last limit, from the
    governor's own segment writes) is never applied again."""
    pools = inproc_pools
    manager = pools.make()
    governor = governor_of(manager)
    held = manager.alloc(2 * BLOCKS_PER_PAGE)
    _settle()
    status = governor.status()
    old_limit = status["limit_bytes"]
    assert status["governed"] and old_limit < status["virtual_bytes"]
    wait_for(lambda: governor.status()["kvctl_target_bytes"] == old_limit,
             what="kvcached's kvctl watcher to take the governor's segment write as its sticky target")

    if cause == "evicted":
        with pools.admin() as admin:
            admin.evict(_session_id(pools))
    else:
        pools.broker.server.stop()
    beyond = old_limit // POOL_PAGE_BYTES * BLOCKS_PER_PAGE  # more than the old limit holds
    assert manager.alloc(beyond) is None  # a miss: the governor asks the broker, and finds out
    wait_for(lambda: not governor.governed, what="the governor to stop governing")
    _settle()  # the round that ungoverned it lifts the limit, then shows it in the segment

    status = governor.status()
    assert status["limit_bytes"] == status["virtual_bytes"]
    assert segment.read(manager.ipc_name).total_bytes == status["virtual_bytes"]
    assert manager.alloc(beyond) is not None  # kvcached alone: the old limit is not re-applied
    assert manager.page_allocator.get_num_total_pages() * POOL_PAGE_BYTES == status["virtual_bytes"]
    manager.free(held)


def test_a_broker_failure_anywhere_in_the_process_ungoverns_the_pool(inproc_pools):
    """The broker stops answering and another reporter of the process finds out first (here a
    report; on a loaded machine it was the pool's own usage views, before any grow): the pool
    is no longer arbitrated, so it runs as kvcached alone at its next round, without needing a
    miss of its own to ask the broker again."""
    from kvcached_broker.adapters import sessions

    pools = inproc_pools
    manager = pools.make()
    governor = governor_of(manager)
    _settle()
    assert governor.governed
    pools.broker.server.stop()
    pools.broker.thread.join(timeout=30)
    assert not pools.broker.thread.is_alive()
    assert sessions.existing(pools.identity_of()).report("another-reporter", {"side_pool": MIB}) is None  # now unprotected
    _settle()
    status = governor.status()
    assert not status["governed"] and "unprotected" in status["why_ungoverned"]
    assert status["limit_bytes"] == status["virtual_bytes"]
    assert segment.read(manager.ipc_name).total_bytes == status["virtual_bytes"]


def test_a_limit_agreed_while_kvcached_preallocates_applies_at_that_sync(inproc_pools):
    """kvcached's page preallocation maps pages outside its allocator's lock: they are neither
    free nor reserved meanwhile, so a shrink at that moment fails and kvcached defers it, with
    nothing in use above the limit.  The sync point applies its agreed limit all the same (a
    deferred limit would leave this rank's capacity unlike its TP peers' until blocks are freed)."""
    from kvcached_broker.adapters.kvcached import agreement

    pools = inproc_pools
    manager = pools.make()
    _settle()
    allocator = governor_of(manager).real
    agreed = agreement.Agreement()
    agreed.sync(None, None)

    pause = Pause(f"kvcached-prealloc-g{allocator.group_id}")
    allocator._map_pages = pause.hook(allocator._map_pages)
    # a preallocation begun before the hook would refill the reserve after the trim, and the
    # one triggered next would find nothing to map
    wait_for(lambda: allocator._in_flight == 0, what="the preallocation under way to finish its maps")
    allocator.trim()  # its reserved pages go back to the free list...
    allocator._trigger_preallocation()  # ...and the preallocation takes some of them to map
    assert pause.inside.wait(60), "kvcached's preallocation never started mapping"
    in_use, total = allocator.get_num_inuse_pages(), allocator.get_num_total_pages()
    limit = in_use + 1
    assert allocator._in_flight >= 2 and limit < total

    shrinks = []
    real_resize = allocator.resize

    def resize(size):
        done = real_resize(size)
        shrinks.append(done)
        if not done:  # the shrink met the maps in flight: let them land
            pause.go.set()
            wait_for(lambda: allocator._in_flight == 0, what="the preallocation to finish its maps")
        return done

    allocator.resize = resize
    agreed.want(manager, limit)
    record = agreed.sync(None, None)
    assert shrinks[0] is False  # kvcached deferred the first attempt
    assert record.agreed_pages == [limit] and record.limit_pages == [limit]
    pause.go.set()


def test_an_ungoverned_pool_with_a_limit_channel_is_lifted_only_through_the_channel(inproc_pools):
    """SGLang's ranks agree on limits at sync points: the lift is a limit the channel applies
    there, and neither the stale target nor the lift's own segment write changes this rank's
    capacity on an allocation in between."""
    from kvcached_broker.adapters.kvcached import kvcached_api, limits

    class HeldChannel(limits.DirectLimits):
        """Records what the governor wants; applies it only when the test's sync point comes."""

        def __init__(self):
            self.wanted: list[int] = []
            self.governor = None

        def apply(self, governor, manager, limit_bytes):
            self.governor = governor
            self.wanted.append(limit_bytes)
            return kvcached_api.limit_state(manager)

        def sync(self, manager):
            return limits.DirectLimits().apply(self.governor, manager, self.wanted[-1])

    channel = HeldChannel()
    limits.set_factory(lambda geometry: channel)
    pools = inproc_pools
    manager = pools.make()
    governor = governor_of(manager)
    size = manager.page_allocator.get_num_total_pages()
    wait_for(lambda: governor.status()["kvctl_target_bytes"] == size * POOL_PAGE_BYTES,
             what="kvcached's kvctl watcher to take the governor's segment write as its sticky target")
    with pools.admin() as admin:
        admin.evict(_session_id(pools))
    assert manager.alloc(size * BLOCKS_PER_PAGE) is None  # beyond the size: the governor finds out
    wait_for(lambda: not governor.governed, what="the governor to stop governing")
    virtual = governor.status()["virtual_bytes"]
    assert channel.wanted[-1] == virtual
    wait_for(lambda: governor.status()["kvctl_target_bytes"] == virtual,
             what="kvcached's kvctl watcher to see the lifted segment")
    assert manager.alloc(BLOCKS_PER_PAGE) is not None
    assert manager.page_allocator.get_num_total_pages() == size  # unchanged until the sync point
    assert channel.sync(manager).status == "applied"
    assert manager.page_allocator.get_num_total_pages() * POOL_PAGE_BYTES == virtual


# ------------------------------------------------------------------ outside limits
def test_an_outside_memory_limit_is_an_operator_cap_and_never_makes_the_governor_stale(inproc_pools):
    from kvcached import control

    pools = inproc_pools
    manager = pools.make()
    governor = governor_of(manager)
    _settle()
    granted = pools.granted_pool_pages()
    limit = manager.page_allocator.get_num_total_pages()
    assert 0 < limit <= granted

    state = control.set_instance_memory_limit(64 * GIB, revision=10 ** 9)  # far above the grant
    assert state["status"] == "applied" and state["pools"][0]["reason"] == "kvcached_broker_operator_cap"
    assert manager.page_allocator.get_num_total_pages() == limit  # never above the grant
    _settle()
    assert governor.status()["operator_cap_bytes"] == governor.status()["virtual_bytes"]  # kvcached's share of it
    assert manager.page_allocator.get_num_total_pages() <= pools.granted_pool_pages()

    governor.ask_back(limit // 2)  # the governor's own limits still apply: newer than 10**9
    _settle()
    assert manager.page_allocator.get_num_total_pages() <= limit - limit // 2
    assert manager.memory_limit_state()["revision"] > 10 ** 9
    assert pools.granted_pool_pages() < granted

    lowered = control.set_instance_memory_limit(2 * POOL_PAGE_BYTES, revision=10 ** 9 + 1)  # a cap below it
    assert lowered["status"] == "deferred"
    wait_for(lambda: manager.page_allocator.get_num_total_pages() <= 2 and pools.granted_pool_pages() <= 2,
             what="the limit and the grant to come down to the cap")
    assert governor.status()["operator_cap_bytes"] == 2 * POOL_PAGE_BYTES
    assert control.set_instance_memory_limit(GIB, revision=1)["status"] == "stale"


# ------------------------------------------------------------------ pool start fails safe
def _resolver_fails(pools, monkeypatch):
    from kvcached_broker.adapters.kvcached import identity

    def broken(geometry):
        raise RuntimeError("resolver broke")

    identity.set_resolver(broken)
    return "resolver broke"


def _base_refused(pools, monkeypatch):
    from kvcached_broker.adapters.device_session import DeviceSession
    from kvcached_broker.client import BudgetExceeded

    def refused(session):
        raise BudgetExceeded("runtime_base does not fit", code="budget_exceeded")

    monkeypatch.setattr(DeviceSession, "pin_base", refused)
    return "runtime_base does not fit"


def _evicted_at_start(pools, monkeypatch):
    with pools.admin() as admin:
        admin.evict(_session_id(pools))  # the session the pool will use is evicted before it starts
    return "evicted"


@pytest.mark.parametrize("arrange", [_resolver_fails, _base_refused, _evicted_at_start])
def test_a_governor_that_cannot_start_leaves_the_pool_to_kvcached_alone(inproc_pools, monkeypatch, capsys, arrange):
    pools = inproc_pools
    why = arrange(pools, monkeypatch)
    capsys.readouterr()
    manager = pools.make()  # nothing raises into KVCacheManager.__init__
    governor = governor_of(manager)
    assert not governor.governed and why in governor.why_ungoverned
    warned = [line for line in capsys.readouterr().err.splitlines()
              if line.startswith("kvcached-broker: WARNING ") and "event=kvcached_pool_ungoverned" in line]
    assert len(warned) == 1
    assert manager.page_allocator.get_num_total_pages() == governor.geometry.virtual_pages
    assert manager.alloc(BLOCKS_PER_PAGE) is not None


@pytest.mark.parametrize("arrange", [_resolver_fails, _base_refused, _evicted_at_start])
def test_under_kvcached_require_a_governor_that_cannot_start_is_a_startup_error(inproc_pools, monkeypatch, arrange):
    from kvcached_broker.adapters.sessions import BrokerRequired

    pools = inproc_pools
    why = arrange(pools, monkeypatch)
    monkeypatch.setenv("KVCACHED_REQUIRE", "1")
    with pytest.raises(BrokerRequired, match=why):
        pools.make()


# ------------------------------------------------------------------ the lock
def test_a_pool_that_starts_empty_has_a_real_lock_before_the_engine_calls_it(inproc_pools):
    """kvcached's no-op lock (synchronous scheduling) is made real at construction: a limit
    change never runs while the engine is inside a kvcached call, and an early allocation that
    waits for the null block (which waits for a grant) does not hold the lock meanwhile."""
    pools = inproc_pools
    with pools.admin() as admin:
        admin.limit(INSTANCE, max_bytes=0)  # the first grant is refused: the pool starts empty
    manager = pools.make(wait=False)
    governor = governor_of(manager)
    rlock = type(threading.RLock())
    assert isinstance(manager._lock, rlock)
    assert governor.counters["refusals"] >= 1 and manager.page_allocator.get_num_total_pages() == 0

    pause = Pause("engine")
    manager.page_allocator.get_resize_target = pause.hook(manager.page_allocator.get_resize_target)
    got: list = []
    engine = threading.Thread(target=lambda: got.append(manager.alloc(1)), name="engine", daemon=True)
    engine.start()  # before kvcached's post-init: it waits for the null block
    with pools.admin() as admin:
        admin.limit(INSTANCE, max_bytes=None)  # now the governor's retry is granted
    assert pause.inside.wait(60), "the engine's allocation never got past kvcached's post-init"
    assert manager._post_init_done.is_set() and manager.null_block == [0]  # block 0, as SGLang needs
    assert not manager._lock.acquire(blocking=False)  # the engine's call holds it: a limit change waits
    pause.go.set()
    engine.join(60)
    assert got and got[0] is not None
    assert manager._lock is not None and isinstance(manager._lock, rlock)


# ------------------------------------------------------------------ shutdown
def test_shutdown_gives_back_only_what_kvcached_unmapped(inproc_pools):
    pools = inproc_pools
    manager = pools.make()
    governor = governor_of(manager)
    held = manager.alloc(3 * BLOCKS_PER_PAGE)
    _settle()
    assert pools.granted_pool_pages() > 4
    assert manager.shutdown()
    _settle()
    mapped = manager.page_allocator.get_num_inuse_pages() + manager.page_allocator.get_num_reserved_pages()
    assert mapped >= 4  # the null block's page and three more: still mapped
    assert pools.granted_pool_pages() == mapped  # the rest went back
    manager.free(held)  # blocks freed after shutdown: what kvcached unmaps goes back too
    wait_for(lambda: pools.granted_pool_pages() == manager.page_allocator.get_num_inuse_pages()
             + manager.page_allocator.get_num_reserved_pages() < mapped, what="the freed pages to go back")
    assert governor.closed


def test_an_alloc_racing_a_closed_pools_give_back_hangs_neither_the_engine_nor_the_governors(inproc_pools):
    """A closed pool's give-back trims kvcached's reserve on the governors' thread.  kvcached's
    ``trim`` unmaps the reserve outside its allocator's mutex and puts the pages on the free list
    without waking anyone, and an ``alloc_page`` that finds neither a reserved nor a free page
    (with pages still counted free) waits for that wake-up, holding the manager's lock.  So the
    give-back trims under the manager's lock, as kvcached's own ``trim`` does: an engine's alloc
    that came in between waited forever, and the governors' thread, which reads the mapped count
    under that lock next, with it."""
    pools = inproc_pools
    manager = pools.make()
    governor = governor_of(manager)
    allocator = governor.real
    held = [manager.alloc(BLOCKS_PER_PAGE) for _ in range(4)]  # pages 0 (with the null block) to 4
    _settle()
    assert manager.shutdown()
    _settle()
    assert allocator.get_num_reserved_pages() == 0 and allocator.get_num_free_pages() == 0  # shrunk to its use

    pause = Pause("kvcached-broker-governor")
    allocator._unmap_pages = pause.hook(allocator._unmap_pages)
    for blocks in held[1:]:
        manager.free(blocks)  # whole pages freed after shutdown: kvcached's reserve; the governors' thread wakes
    assert pause.inside.wait(60), "the governors' thread never trimmed the closed pool's reserve"

    lock, real_alloc = manager._lock, manager._alloc
    met_the_lock = threading.Event()

    def alloc_noting_the_lock(need_size, _skip_wait=False):
        if not lock.acquire(blocking=False):
            met_the_lock.set()  # the give-back holds the manager's lock: the engine waits for it
            lock.acquire()
        try:
            return real_alloc(need_size, _skip_wait=_skip_wait)
        finally:
            lock.release()

    manager._alloc = alloc_noting_the_lock
    got: list = []
    need = manager.num_avail_blocks + 1  # one more block than the pages in use have free: a page is needed
    engine = threading.Thread(target=lambda: got.append(manager.alloc(need)), name="engine", daemon=True)
    engine.start()
    try:
        wait_for(lambda: met_the_lock.is_set() or len(allocator._cond._waiters) > 0,
                 what="the engine's alloc to wait for the manager's lock or for a page")
        pause.go.set()
        engine.join(60)
        assert not engine.is_alive(), "the engine's alloc waits for a page nobody will wake it for"
        assert runner.settle(1, timeout_s=60), "the governors' thread never finished its round"
        assert got == [None]  # the closed pool has nothing left to map: a miss
    finally:
        pause.go.set()
        with allocator._cond:  # after a failure: wake the alloc that waits, so that the threads end
            allocator._cond.notify_all()


def test_a_shrink_the_engine_overtook_is_withdrawn_and_the_engine_gets_the_pages_it_was_granted(inproc_pools,
                                                                                                monkeypatch):
    """The governor lowers the limit over free pages it has no use for, and the engine's next
    burst takes them between the governor's look and kvcached's resize.  kvcached defers the
    lower limit below what is now in use, and while it is deferred it serves no free page: the
    engine ran short with pages granted and mapped nowhere, and the governor, waiting for frees
    that a short engine does not make, asked for nothing (the gpu-check's bursts stalled so).
    The shrink is withdrawn instead: the limit stays, and the engine's allocations go on."""
    pools = inproc_pools
    manager = pools.make()
    _settle()
    governor = governor_of(manager)
    allocator = governor.real
    held = []
    while allocator.get_num_inuse_pages() < 60:  # a burst: the governor grows ahead of it
        got = manager.alloc(BLOCKS_PER_PAGE)
        if got is None:
            runner.settle(1)  # a scheduling miss: the next step retries
            continue
        held.append(got)
    _settle()

    pause = Pause("kvcached-broker-governor")
    lowering: list[int] = []
    paused_set_limit = pause.hook(governor._set_limit)

    def set_limit(manager_, limit_pages):
        lowering.append(limit_pages)
        return paused_set_limit(manager_, limit_pages)

    monkeypatch.setattr(governor, "_set_limit", set_limit)
    for blocks in held[2:]:
        manager.free(blocks)  # the burst ends: far more free than the pool keeps; the governor shrinks
    held = held[:2]
    assert pause.inside.wait(60), "the governor never lowered the limit"
    target = lowering[0]
    assert target < allocator.get_num_total_pages()
    while allocator.get_num_inuse_pages() <= target:  # the next burst, before the resize
        got = manager.alloc(BLOCKS_PER_PAGE)
        assert got is not None
        held.append(got)
    pause.go.set()
    _settle()

    assert governor.pending_limit is None and manager.memory_limit_state()["status"] == "applied"
    assert allocator.get_num_total_pages() > allocator.get_num_inuse_pages() + 1  # granted pages free, usable
    granted = governor.grants.pages
    for _ in range(4):  # the engine's burst goes on within its grant: no miss
        got = manager.alloc(BLOCKS_PER_PAGE)
        assert got is not None, "the engine ran short with pages granted"
        held.append(got)
    assert allocator.get_num_inuse_pages() + allocator.get_num_reserved_pages() <= governor.grants.pages >= granted
    assert governor.counters["withdrawn"] == 1 and governor.status()["withdrawn"] == 1


# ------------------------------------------------------------------ the engine's path
def test_allocations_within_the_limit_make_no_broker_round_trip(inproc_pools, monkeypatch):
    """Grow ahead of need: the engine's alloc and free only read counters and wake the governors'
    thread; every broker request runs there."""
    pools = inproc_pools
    client = pools.client()
    requests: list[str] = []
    for name in ("acquire", "release", "reserve", "status", "heartbeat", "acquire_tp"):
        real = getattr(client, name)

        def counted(*args, _real=real, **kwargs):
            requests.append(threading.current_thread().name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(client, name, counted)
    manager = pools.make()
    _settle()
    governor = governor_of(manager)
    limit_pages = manager.page_allocator.get_num_total_pages()
    engine_thread = threading.current_thread().name
    before = len(requests)
    held = []
    for _ in range(3 * limit_pages):  # three limits' worth of single pages: the pool grows meanwhile
        got = manager.alloc(BLOCKS_PER_PAGE // 2)
        if got is None:
            _settle()  # a scheduling miss: the next step retries
            continue
        held.append(got)
    for blocks in held:
        manager.free(blocks)
    _settle()
    assert governor.counters["grows"] >= 2 and len(requests) > before  # the governor did ask
    assert engine_thread not in requests[before:]


def test_the_governors_own_limits_stay_its_own_under_another_libraries_wrapper(inproc_pools, monkeypatch):
    """A wrapper made over the patched ``set_memory_limit`` (``functools.wraps``, as a tracing or
    profiling library does) puts a frame between the governor's limit channel and the patch: the
    governor's limits are still its own (no operator cap appears, the limit follows the grant),
    and a call from outside through that wrapper is still an operator cap."""
    import functools

    import kvcached.kv_cache_manager as kvm

    patched = kvm.KVCacheManager.set_memory_limit

    @functools.wraps(patched)
    def traced(self, limit_bytes, *, revision):
        return patched(self, limit_bytes, revision=revision)

    monkeypatch.setattr(kvm.KVCacheManager, "set_memory_limit", traced)
    manager = inproc_pools.make()
    governor = governor_of(manager)
    _settle()
    limit = manager.page_allocator.get_num_total_pages()
    assert limit > 1 and governor.status()["operator_cap_bytes"] is None
    governor.ask_back(limit // 2)
    _settle()
    assert manager.page_allocator.get_num_total_pages() <= limit - limit // 2
    assert governor.status()["operator_cap_bytes"] is None  # its own lower limit, not an operator's
    revision = manager.memory_limit_state()["revision"] + 1
    assert manager.set_memory_limit(2 * POOL_PAGE_BYTES, revision=revision)["reason"] == "kvcached_broker_operator_cap"
    _settle()
    assert governor.status()["operator_cap_bytes"] == 2 * POOL_PAGE_BYTES


# ------------------------------------------------------------------ the patch
def test_the_patch_wraps_once(inproc_pools):
    import kvcached.kv_cache_manager as kvm

    from kvcached_broker.adapters.kvcached import patches
    from kvcached_broker.adapters.patching import WRAPPED

    wrapped = {name: vars(kvm.KVCacheManager)[name] for name in ("__init__", "shutdown", "set_memory_limit")}
    factory = kvm.PageAllocator
    patches.patch_kv_cache_manager(kvm)  # again
    assert kvm.PageAllocator is factory and getattr(factory, WRAPPED)
    for name, method in wrapped.items():
        assert vars(kvm.KVCacheManager)[name] is method and getattr(method, WRAPPED)
    manager = inproc_pools.make()
    assert governor_of(manager).governed
    assert MIB  # (helpers' units, used across this module)
