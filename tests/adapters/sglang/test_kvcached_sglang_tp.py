"""kvcached mode in SGLang: TP ranks size alike, agree at every sync point, and give back together.

Two SGLang ranks (``sglang_rank.py``), each on its own simulated 1 GiB GPU with its own broker,
joined in one gloo group as SGLang's TP group; each builds a real kvcached pool through
kvcached's SGLang integration and runs the real, patched ``Scheduler.ingest_requests`` as its
iterations.  Both ranks always get the same requests, as SGLang's broadcast gives them.
"""

from __future__ import annotations

import pytest
from kvcached_sglang_harness import overlay  # noqa: F401  (autouse: kvcached and SGLang at the overlay's versions)
from kvcached_sglang_harness import gpu_broker, ranks, sampler  # noqa: F401  (fixtures)
import math

import subprocess
import sys

from kvcached_sglang_harness import POOL_PAGE_BYTES, SESSION_PAGE_BYTES, on_all, session_pages
from helpers import MIB, python_env, wait_for

from kvcached_broker.client import BrokerClient

pytestmark = pytest.mark.runtime("kvcached", "sglang")

TOKENS_PER_PAGE = 1024  # 64 blocks of 16 tokens in one 2 MiB page per layer
SESSION_PAGES_PER_POOL_PAGE = POOL_PAGE_BYTES // SESSION_PAGE_BYTES
BATCH_PAGES = 4  # KVCACHED_BROKER_KV_BATCH=64MiB of 16 MiB pool pages


def fill(group, pages: int, rounds: int = 400) -> int:
    """Admit and allocate one-page requests on every rank alike until ``pages`` are in use; a
    miss is a scheduling miss: the ranks run iterations (sync points) and try again."""
    for _ in range(rounds):
        done = on_all(group, "allocate", requests=4, tokens=TOKENS_PER_PAGE)
        assert done[0]["allocated"] == done[1]["allocated"], "the ranks admitted differently"
        assert not done[0]["errors"] and not done[1]["errors"], "an allocation raised inside SGLang"
        if done[0]["inuse_pages"] - 1 >= pages:  # the null block's page
            return done[0]["inuse_pages"] - 1
        on_all(group, "step", n=20)
    raise AssertionError(f"could not fill {pages} pages: {done}")


def assert_one_shared_segment(group, built) -> None:
    """The ranks' pools share one kvcached segment (kvcached's default name, per process group)."""
    names = {b["pools"][0]["ipc_name"] for b in built}
    assert names == {group[0].ipc_name} == {p.ipc_name for p in group}, names


def assert_agreed_at_every_sync(group) -> int:
    logs = [process.request("records")["records"] for process in group]
    assert logs[0] and len(logs[0]) == len(logs[1])
    for mine, theirs in zip(*logs):
        assert mine["number"] == theirs["number"]
        assert mine["agreed_pages"] == theirs["agreed_pages"]
        assert mine["limit_pages"] == theirs["limit_pages"], (mine, theirs)
        assert mine["evicted_pages"] == theirs["evicted_pages"]
    return len(logs[0])


def test_tp_pair_sizes_alike_agrees_at_every_sync_and_gives_back_together(gpu_broker, ranks, sampler):
    b0, b1 = gpu_broker(0), gpu_broker(1)
    with b1.admin() as admin:
        admin.limit("model-tp", max_bytes=900 * MIB)  # rank 1's broker could never give it more
    group = ranks([b0.endpoint, b1.endpoint])

    # Sizing: kvcached's virtual budget (0.9 x 1 GiB, MIN over the world group), capped by the
    # broker at what it could ever give once SGLang's slack (0.1 x 1 GiB, held) is charged
    # (rank 1: 900 MiB less the slack), agreed by both ranks; no KV hold.
    slack = math.ceil((1 << 30) * (1 - 0.9))
    sized = on_all(group, "profile", free_bytes=1 << 30, pre_model_load_bytes=1 << 30)
    assert sized[0]["kv_bytes"] == sized[1]["kv_bytes"] == 900 * MIB - slack
    assert sized[0]["held_bytes"] == sized[1]["held_bytes"] == 0
    budget = (1 << 30) - int((1 << 30) * 0.05)  # the broker's default headroom
    assert [s["ever_bytes"] for s in sized] == [budget - slack, 900 * MIB - slack]

    with sampler([(group[0], b0), (group[1], b1)]) as samples:
        pressure_moves_both_ranks_together(group, b0, b1, samples)
    samples.check()
    assert min(samples.peak_mapped.values()) >= 40 * POOL_PAGE_BYTES  # the samples saw the pools full


def pressure_moves_both_ranks_together(group, b0, b1, samples) -> None:
    built = on_all(group, "build")
    assert {b["pool"] for b in built} == {"ElasticMHATokenToKVPool"}
    assert all(b["pools"][0]["governed"] for b in built)
    assert_one_shared_segment(group, built)

    used = fill(group, 40)  # 640 MiB of KV on each rank: grants grow as the limits agree
    samples.observe()
    before = on_all(group, "status")
    limit = before[0]["limit_pages"]
    assert limit == before[1]["limit_pages"] >= used + 1
    for broker in (b0, b1):
        assert session_pages(broker, "model-tp") >= limit * SESSION_PAGES_PER_POOL_PAGE

    on_all(group, "finish", requests=24)  # requests end; their prefixes stay cached (evictable)
    cached = on_all(group, "status")
    assert cached[0]["evictable_tokens"] == cached[1]["evictable_tokens"] == 24 * TOKENS_PER_PAGE

    # Pressure on rank 0's broker only: a neighbour wants 400 MiB of its GPU.
    neighbour = BrokerClient.connect("neighbour", endpoint=b0.endpoint, credit_pages=0)
    try:
        assert neighbour.acquire(200, min_pages=200) == 0  # refused: the room is model-tp's
        after = on_all(group, "step", limit_at_most=limit - 1)  # every rank stops at the same sync
        assert after[0]["record"] == after[1]["record"]
        lowered = after[0]["record"]["agreed_pages"][0]
        assert lowered < limit
        # Both ranks gave back, identically: the same limit and the same prefix evictions; each
        # rank's broker got back at least what the group's limit fell by, and holds no more than
        # that limit plus one batch (a rank may stand ready to grow again).
        on_all(group, "step", n=50)
        final = on_all(group, "status")
        shrunk = final[0]["limit_pages"]
        assert shrunk == final[1]["limit_pages"] <= lowered  # applied (a deferred limit once evictions freed)
        assert final[0]["evictable_tokens"] == final[1]["evictable_tokens"] < 24 * TOKENS_PER_PAGE
        assert final[0]["running"] == final[1]["running"] == used - 24  # running requests keep their KV
        for rank, broker in enumerate((b0, b1)):
            pool, was = final[rank]["pools"][0], before[rank]["pools"][0]
            assert pool["pages_released"] - was["pages_released"] >= limit - shrunk
            granted_pages = pool["granted_bytes"] // POOL_PAGE_BYTES
            assert shrunk <= granted_pages <= shrunk + BATCH_PAGES
            wait_for(lambda rank=rank, broker=broker: session_pages(broker, "model-tp") == SESSION_PAGES_PER_POOL_PAGE
                     * (group[rank].request("status")["pools"][0]["granted_bytes"] // POOL_PAGE_BYTES),
                     what="the broker's books and the rank's grant agree")
        wait_for(lambda: neighbour.acquire(200, min_pages=1) > 0, what="the neighbour got room on GPU 0")
    finally:
        neighbour.close()
    assert assert_agreed_at_every_sync(group) > 100
    final = on_all(group, "status")
    assert not any(s["errors"] for s in final)
    assert [s["pools"][0]["operator_cap_bytes"] for s in final] == [None, None]  # a peer's write is no cap


def test_a_rank_without_a_broker_takes_part_and_the_governed_rank_bounds_both(gpu_broker, ranks, sampler):
    b0 = gpu_broker(0)
    with b0.admin() as admin:
        admin.limit("model-tp", max_bytes=320 * MIB)  # rank 0 can hold at most ~18 pool pages
    group = ranks([b0.endpoint, "off"])
    sized = on_all(group, "profile", free_bytes=1 << 30, pre_model_load_bytes=1 << 30)
    assert sized[0]["kv_bytes"] == sized[1]["kv_bytes"]  # the unprotected rank still joined the min-reduce
    with sampler([(group[0], b0)]) as samples:  # the governed rank's bound
        built = on_all(group, "build")
        assert [b["pools"][0]["governed"] for b in built] == [True, False]
        assert_one_shared_segment(group, built)
        on_all(group, "step", n=5)  # no deadlock: the unprotected rank offers no constraint
        for _ in range(60):
            done = on_all(group, "allocate", requests=4, tokens=TOKENS_PER_PAGE)
            assert done[0]["allocated"] == done[1]["allocated"]
            on_all(group, "step", n=20)
        samples.observe()
    samples.check()
    status = on_all(group, "status")
    assert status[0]["limit_pages"] == status[1]["limit_pages"]  # the governed rank bounds both
    assert status[1]["limit_pages"] * POOL_PAGE_BYTES <= 320 * MIB
    assert status[0]["inuse_pages"] == status[1]["inuse_pages"]
    assert not status[0]["errors"] and not status[1]["errors"]
    assert_agreed_at_every_sync(group)


def test_a_kvctl_write_on_the_ranks_shared_segment_caps_both_ranks_alike(gpu_broker, ranks, sampler):
    b0, b1 = gpu_broker(0), gpu_broker(1)
    group = ranks([b0.endpoint, b1.endpoint])
    with sampler([(group[0], b0), (group[1], b1)]) as samples:
        built = on_all(group, "build")
        assert_one_shared_segment(group, built)
        fill(group, 16)
        inuse = on_all(group, "status")[0]["inuse_pages"]
        grown = on_all(group, "step", limit_at_least=inuse + 2)  # the ranks grew ahead of need, together
        assert grown[0]["record"] == grown[1]["record"]
        cap = inuse + 1  # below the ranks' limit, above what they use
        done = subprocess.run([sys.executable, "-m", "kvcached.cli.kvctl", "limit", group[0].ipc_name,
                               f"{cap * POOL_PAGE_BYTES}"], capture_output=True, text=True, timeout=60, env=python_env())
        assert done.returncode == 0, done.stderr
        after = on_all(group, "step", limit_at_most=cap)  # both ranks lower to it at the same sync
        assert after[0]["record"] == after[1]["record"]
        status = on_all(group, "status")
        assert [s["pools"][0]["operator_cap_bytes"] for s in status] == [cap * POOL_PAGE_BYTES] * 2
        assert status[0]["limit_pages"] == status[1]["limit_pages"] <= cap
        for _ in range(10):  # full at the cap: scheduling misses, never growth past it, never an exception
            done = on_all(group, "allocate", requests=4, tokens=TOKENS_PER_PAGE)
            assert done[0]["allocated"] == done[1]["allocated"] and not done[0]["errors"] and not done[1]["errors"]
            on_all(group, "step", n=20)
        status = on_all(group, "status")
        assert status[0]["limit_pages"] == status[1]["limit_pages"] <= cap
        assert status[0]["inuse_pages"] == status[1]["inuse_pages"] <= cap
        samples.observe()
    samples.check()
    assert_agreed_at_every_sync(group)
