"""kvcached mode in SGLang: what happens inside a sync point stays safe on every rank.

Two SGLang ranks (``sglang_rank.py``) on their own simulated GPUs and brokers, in one gloo
group, run the real, patched ``Scheduler.ingest_requests`` as their iterations:

* the grant a rank offers into a sync point is held until that sync applied its limit: broker
  pressure that reaches the rank's governor while the scheduler is inside the collective
  never leaves kvcached's limit above the grant (the sampler checks mapped <= granted);
* a rank whose work before the collective fails (its radix cache, SGLang's parallel state)
  still takes part in every collective, and nothing raises into SGLang.
"""

from __future__ import annotations

import pytest
from kvcached_sglang_harness import overlay  # noqa: F401  (autouse: kvcached and SGLang at the overlay's versions)
from kvcached_sglang_harness import gpu_broker, ranks, sampler  # noqa: F401  (fixtures)
from kvcached_sglang_harness import POOL_PAGE_BYTES, on_all
from test_kvcached_sglang_tp import BATCH_PAGES, TOKENS_PER_PAGE, assert_agreed_at_every_sync, fill

pytestmark = pytest.mark.runtime("kvcached", "sglang")


def test_pressure_while_a_rank_is_inside_the_collective_never_lifts_its_limit_above_its_grant(gpu_broker, ranks,
                                                                                               sampler):
    b0, b1 = gpu_broker(0), gpu_broker(1)
    group = ranks([b0.endpoint, b1.endpoint])
    with sampler([(group[0], b0), (group[1], b1)]) as samples:
        on_all(group, "build")
        fill(group, 8)
        inuse = on_all(group, "status")[0]["inuse_pages"]
        on_all(group, "step", limit_at_least=inuse + 3)  # the ranks grew ahead of need
        status = on_all(group, "status")
        limit = status[0]["limit_pages"]
        assert status[1]["limit_pages"] == limit and status[1]["inuse_pages"] == inuse

        # Both ranks run short with no iteration to sync at: each governor takes a batch from its
        # broker and wants a raise; its bounded wait for the sync point times out (the raise
        # stays wanted, the grant stays held above the limit).
        done = on_all(group, "allocate", requests=limit - inuse - 1, tokens=TOKENS_PER_PAGE)
        assert done[0]["allocated"] == done[1]["allocated"] > 0
        wanted = on_all(group, "want_raise")
        assert all(w["wanted"] for w in wanted), wanted
        assert min(w["wanted_pages"] for w in wanted) > limit

        # The next sync point: rank 0 offers its grant, then, while it is inside the all-reduce,
        # its broker asks for a batch back.
        group[0].request("pressure_inside_next_collective", pages=BATCH_PAGES)
        after = on_all(group, "step", n=1)
        assert after[0]["record"] == after[1]["record"]
        raised = after[0]["record"]["limit_pages"][0]
        assert raised > limit  # the ranks agreed on the raise and applied it
        race = group[0].request("race_result")
        pool = group[0].request("status")["pools"][0]
        assert pool["limit_bytes"] <= pool["granted_bytes"], (race, pool)  # the offer was held
        assert race["waited"] == 1 and race["released_inside"] == 0, race

        # Afterwards the pressure is answered as usual: the ranks lower together and rank 0
        # gives back; every limit stays within its rank's grant.
        on_all(group, "step", n=100)
        final = on_all(group, "status")
        assert final[0]["limit_pages"] == final[1]["limit_pages"]
        for rank in final:
            assert rank["pools"][0]["limit_bytes"] <= rank["pools"][0]["granted_bytes"]
            assert not rank["errors"]
        assert final[0]["pools"][0]["pages_released"] > 0
        samples.observe()
    samples.check()
    assert min(samples.peak_mapped.values()) >= 8 * POOL_PAGE_BYTES
    assert_agreed_at_every_sync(group)


def test_a_rank_whose_work_before_the_collective_fails_still_takes_part_and_nothing_raises(gpu_broker, ranks):
    b0, b1 = gpu_broker(0), gpu_broker(1)
    group = ranks([b0.endpoint, b1.endpoint])
    on_all(group, "build")
    on_all(group, "step", n=3)
    group[1].request("break_before_sync")  # its radix cache and SGLang's parallel state now raise
    after = on_all(group, "step", n=5)  # (a rank that raised here would leave its peer in the all-reduce)
    assert after[0]["record"] == after[1]["record"]
    assert after[0]["record"]["number"] == 8
    assert not any(s["errors"] for s in on_all(group, "status"))
    assert assert_agreed_at_every_sync(group) == 8
