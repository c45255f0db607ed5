"""One kvcached segment, several governed pools: what a governor takes for an operator's cap.

kvcached names a pool's ``/dev/shm`` segment per process group (``KVCACHED_IPC_NAME``, else
``kvcached_<engine>_<pgid>``), so every TP rank of an SGLang server writes the same one, and so
can pools of servers started in one process group.  Here real governors (``PoolGovernor``)
share one segment, written also by kvcached's own code: its start-up write
(``init_kv_cache_limit``, what kvcached's tracker does when a pool is created) and kvctl's
``update_kv_cache_limit`` (what ``kvctl limit`` runs).  A peer's write is never an operator's
cap; kvctl's is, for every pool on the segment.  The governors' kvctl rounds are driven one at
a time, in the orders the governors' threads can run them.
"""

from __future__ import annotations

import os
import uuid

import pytest
from kvcached_sglang_harness import overlay  # noqa: F401  (autouse: kvcached and SGLang at the overlay's versions)
from helpers import FixedGrants as Grants
from helpers import KvcachedAllocator as Allocator

from kvcached_broker.adapters.kvcached import segment
from kvcached_broker.adapters.kvcached.geometry import PoolGeometry
from kvcached_broker.adapters.kvcached.governor import PoolGovernor
from kvcached_broker.adapters.kvcached.policy import Grow, Shrink, Watermarks, decide

pytestmark = pytest.mark.runtime("kvcached", "sglang")

VIRTUAL_PAGES = 56
PAGE_BYTES = (2 << 20) * 4 * 2


@pytest.fixture
def shared():
    """A segment as kvcached creates it for a pool (its whole size as the limit)."""
    from kvcached.cli.utils import init_kv_cache_limit

    name = f"kvb-shared-{uuid.uuid4().hex[:8]}"
    init_kv_cache_limit(name, VIRTUAL_PAGES * PAGE_BYTES)
    yield name
    for path in (segment.path_of(name), segment.sidecar_path(name)):
        if os.path.exists(path):
            os.unlink(path)


def governor(ipc_name: str, allocator: Allocator, virtual_pages: int = VIRTUAL_PAGES) -> PoolGovernor:
    geometry = PoolGeometry(num_layers=4, page_size=2 << 20, num_kv_buffers=2, virtual_pages=virtual_pages,
                            ipc_name=ipc_name)
    return PoolGovernor(geometry, allocator, Grants(), marks())


def marks() -> Watermarks:
    return Watermarks.for_page_bytes(PAGE_BYTES, 64 << 20)


def kvctl_limit(ipc_name: str, pages: int) -> None:
    """``kvctl limit IPC SIZE``: kvcached's own write."""
    from kvcached.cli.utils import update_kv_cache_limit

    assert update_kv_cache_limit(ipc_name, pages * PAGE_BYTES) is not None


def kvctl_round(*governors: PoolGovernor) -> None:
    """Each governor's kvctl part of a round, in this order: read the segment, then show its limit."""
    for g in governors:
        g._read_operator_cap()
        g._write_segment()


def shown_pages(ipc_name: str) -> int:
    return segment.read(ipc_name).total_bytes // PAGE_BYTES


def test_the_ranks_limits_after_an_agreed_raise_are_no_operator_cap(shared):
    ranks = [Allocator(8), Allocator(8)]
    g0, g1 = (governor(shared, a) for a in ranks)
    kvctl_round(g0, g1)  # both show 8 pages
    for allocator in ranks:
        allocator.total = 12  # a sync point raised both ranks' limit
    kvctl_round(g0, g1)  # rank 0's governor runs first; rank 1 then finds rank 0's 12 pages there
    kvctl_round(g1, g0)
    assert g0.operator_cap_pages is None and g1.operator_cap_pages is None
    assert shown_pages(shared) == 12
    ranks[1].inuse = 12  # full: rank 1 grows (a cap of 12 pages would hold it there for good)
    assert isinstance(decide(g1.pages(), marks(), short_pages=4), Grow)
    for allocator in ranks:
        allocator.total = 9  # a sync lowered them; either governor may run first
    kvctl_round(g1, g0)
    assert g0.operator_cap_pages is None and g1.operator_cap_pages is None and g1.pages().ceiling == VIRTUAL_PAGES


@pytest.mark.parametrize("first", [0, 1])
def test_a_kvctl_write_on_a_shared_segment_caps_every_pool_whichever_governor_sees_it(shared, first):
    ranks = [Allocator(12), Allocator(12)]
    governors = [governor(shared, a) for a in ranks]
    kvctl_round(*governors)
    kvctl_limit(shared, 10)
    kvctl_round(governors[first])  # this one finds kvctl's write, and shows its limit again
    assert shown_pages(shared) == 12
    kvctl_round(governors[1 - first])  # the other finds only a governor's write: the cap all the same
    assert [g.operator_cap_pages for g in governors] == [10, 10]
    for g, allocator in zip(governors, ranks):
        assert g.pages().ceiling == 10
        allocator.inuse = 9
        assert decide(g.pages(), marks()) == Shrink(10)  # both lower to the cap
        allocator.inuse = 10
        assert decide(g.pages(), marks(), short_pages=4) == Shrink(10)  # full at the cap: no growth
    kvctl_round(*governors)
    assert [g.operator_cap_pages for g in governors] == [10, 10]  # the cap stays until the operator changes it
    kvctl_limit(shared, 30)
    kvctl_round(*reversed(governors))
    assert [g.operator_cap_pages for g in governors] == [30, 30]


def test_a_pool_joining_the_segment_is_no_operator_cap(shared):
    """kvcached writes a new pool's whole size into the segment when it creates the pool; a
    governor already there may see that before the new pool's governor first shows its limit."""
    from kvcached.cli.utils import init_kv_cache_limit

    a = governor(shared, Allocator(8))
    kvctl_round(a)
    init_kv_cache_limit(shared, 20 * PAGE_BYTES)  # an unrelated server's pool, 20 pages, same process group
    kvctl_round(a)  # a takes it for a cap (it cannot know yet)
    b = governor(shared, Allocator(4), virtual_pages=20)
    kvctl_round(b)  # b's first write: that value was its own start-up write, not an operator's
    kvctl_round(a)
    assert a.operator_cap_pages is None and b.operator_cap_pages is None
    assert a.pages().ceiling == VIRTUAL_PAGES
    kvctl_limit(shared, 6)  # an operator's cap binds both
    kvctl_round(a, b)
    assert a.operator_cap_pages == b.operator_cap_pages == 6


def test_a_record_left_by_a_removed_segment_is_not_the_new_ones(shared):
    from kvcached.cli.utils import init_kv_cache_limit

    old = governor(shared, Allocator(8))
    kvctl_round(old)
    kvctl_limit(shared, 5)
    kvctl_round(old)
    assert old.operator_cap_pages == 5
    os.unlink(segment.path_of(shared))  # the server stopped; its record stays behind
    init_kv_cache_limit(shared, VIRTUAL_PAGES * PAGE_BYTES)  # a new server, same name
    new = governor(shared, Allocator(8))
    kvctl_round(new)
    kvctl_round(new)
    assert new.operator_cap_pages is None and shown_pages(shared) == 8
    segment.forget(shared)
    assert os.path.exists(segment.sidecar_path(shared))  # the segment is there: its record stays
    os.unlink(segment.path_of(shared))
    segment.forget(shared)
    assert not os.path.exists(segment.sidecar_path(shared))
