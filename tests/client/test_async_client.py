"""AsyncBrokerClient: the same contract as the sync client, as coroutines, with many calls in flight."""

from __future__ import annotations

import asyncio

import pytest

from kvcached_broker.client import AsyncBrokerClient, BadRequest, BudgetExceeded

from helpers import GIB, MIB


async def test_async_client_reserve_acquire_release_status(inproc_factory):
    b = inproc_factory(total_bytes=10 * GIB)
    async with await AsyncBrokerClient.connect("async-m", endpoint=b.endpoint, page_bytes=GIB, credit_pages=0) as c:
        assert await c.reserve({"weights": 4 * GIB}) == {"weights": 4 * GIB}
        assert await c.acquire(7) == 0
        assert await c.acquire(7, min_pages=2) == 6
        with pytest.raises(BadRequest):
            await c.release(7)
        await c.release(2)
        status = await c.status()
        assert status["reserved_bytes"] == 4 * GIB and status["granted_bytes"] == 4 * GIB
        with pytest.raises(BudgetExceeded):
            await c.reserve({"weights": 9 * GIB})
    assert b.status()["instances"] == []


async def test_many_concurrent_calls_on_one_client_stay_consistent(inproc_factory):
    b = inproc_factory(total_bytes=64 * MIB * 100)
    async with await AsyncBrokerClient.connect("async-c", endpoint=b.endpoint, page_bytes=64 * MIB, credit_pages=0) as c:

        async def churn(k):
            got = 0
            for _ in range(20):
                got += await c.acquire(1)
            for _ in range(got):
                await c.release(1)
            return got

        results = await asyncio.gather(*(churn(k) for k in range(32)))
        assert sum(results) > 0
        assert c.held_pages == 0
        assert b.ledger.sessions[c.session_id].granted_pages == 0


async def test_async_credit_reserve_serves_pages_without_round_trips(inproc):
    async with await AsyncBrokerClient.connect("async-r", endpoint=inproc.endpoint, credit_pages=8) as c:
        assert await c.acquire(1) == 1
        session = inproc.ledger.sessions[c.session_id]
        granted, grants = session.granted_pages, inproc.server.counters.grants
        for _ in range(20):
            assert await c.acquire(1) == 1
            await c.release(1)
        assert (session.granted_pages, inproc.server.counters.grants) == (granted, grants)  # nothing reached the broker
        assert c.reserve_pages == 8 and c.held_pages == 1


async def test_async_tp_acquire_with_a_coroutine_reduce(inproc_factory):
    b = inproc_factory(total_bytes=4 * GIB)
    async with await AsyncBrokerClient.connect("async-tp", endpoint=b.endpoint, page_bytes=GIB, credit_pages=0) as c:

        async def reduce_min(v):
            return min(v, 2)  # another rank got only 2

        assert await c.acquire_tp(3, reduce_min) == 2
        assert c.held_pages == 2
        assert b.ledger.sessions[c.session_id].granted_pages == 2


async def eventually(predicate, timeout_s: float = 60.0, what: str = "condition"):
    """Poll ``predicate`` on the loop until it holds; the timeout only bounds a failure."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def test_async_background_refills_the_reserve_below_its_low_watermark(inproc):
    async with await AsyncBrokerClient.connect("async-refill", endpoint=inproc.endpoint, credit_pages=8) as c:
        assert await c.acquire(7) == 7  # asked 15: 7 held, 8 in reserve
        assert await c.acquire(6) == 6  # from the reserve: 2 left, below the low watermark of 4
        await eventually(lambda: c.reserve_pages == 8, what="the background refill")
        assert inproc.ledger.sessions[c.session_id].granted_pages == 7 + 6 + 8


async def test_async_pressure_is_answered_in_the_background_by_a_coroutine_callback(inproc_factory):
    b = inproc_factory(total_bytes=10 * GIB)
    async with await AsyncBrokerClient.connect("giver", endpoint=b.endpoint, page_bytes=GIB, credit_pages=0) as giver, \
            await AsyncBrokerClient.connect("needy", endpoint=b.endpoint, page_bytes=GIB, credit_pages=0) as needy:
        assert await giver.acquire(10) == 10

        async def give_back(pages: int) -> int:
            await giver.release(pages)
            return pages

        giver.on_pressure(give_back)
        assert await needy.acquire(5) == 0  # refused: the giver, above its share, is asked for 5
        await eventually(lambda: giver.pressure_log, what="the pressure push to be answered")
        assert giver.pressure_log == [{"asked": 5, "from_reserve": 0, "from_runtime": 5}]
        assert giver.held_pages == 5 and b.ledger.sessions[giver.session_id].granted_pages == 5
        assert await needy.acquire(5) == 5


async def test_async_client_has_the_sync_clients_properties_and_heartbeat(inproc):
    async with await AsyncBrokerClient.connect("async-p", endpoint=inproc.endpoint, credit_pages=0,
                                               background=False) as c:
        await c.reserve({"weights": GIB}, holds={"kv": GIB})
        await c.heartbeat()
        assert (c.endpoint, c.pools, c.holds) == (inproc.endpoint, {"weights": GIB}, {"kv": GIB})
        assert c.lease_s == inproc.server.config.lease_s
