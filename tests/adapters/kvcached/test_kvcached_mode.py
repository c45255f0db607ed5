"""kvcached mode: real kvcached 0.1.6 pools in separate processes whose memory is the broker's grant.

Each pool is a real ``KVCacheManager`` built through kvcached's SGLang integration with the
broker's kvcached patch applied (``kvcached_broker.tools.kvcached_sim.pool_process``).  A
:class:`Sampler` checks at every sample, from start-up on, that what each process has mapped is
at most what the broker granted it and that the device's sum is within the budget.
"""

from __future__ import annotations

import pytest
import shutil
import threading
import time
from types import SimpleNamespace

from kv_harness import GIB, MIB, POOL_PAGE_BYTES, kvctl, session_of
from helpers import wait_for

from kvcached_broker.broker.device import read_shared_usage
from kvcached_broker.tools.shared_gpu import allocation_lock

pytestmark = pytest.mark.runtime("kvcached")

BLOCKS_PER_PAGE = 64  # 16 tokens x 8 heads x 128 x fp16 = 32 KiB per block per layer K; 2 MiB pages


def pages_of(blocks: int) -> int:
    return -(-blocks // BLOCKS_PER_PAGE)


def fill_to_the_cap(pool, broker, timeout_s: float = 300.0) -> dict:
    """Fill ``pool`` until it holds every block its instance's cap allows, on events rather than a
    fill's timeout: the broker has no room under the cap for another pool page, the governor
    has applied what it was granted (``settle``), then a fill for one block more than the pool
    holds misses (an allocation of a single block failed) without getting it.  That fill's reply.
    ``timeout_s`` bounds a failure only."""
    deadline = time.monotonic() + timeout_s

    def no_room() -> bool:
        (inst,) = [i for i in broker.status()["instances"] if i["name"] == pool.instance]
        return inst["max_bytes"] - inst["reserved_bytes"] - inst["granted_bytes"] < POOL_PAGE_BYTES

    while not no_room():
        pool.request("fill", blocks=3000, timeout_s=0.5)  # misses, never an exception
        assert time.monotonic() < deadline, "the pool never grew to its cap"
    pool.request("settle")
    while True:
        before = pool.request("status")
        reply = pool.request("fill", blocks=before["held_blocks"] + 1, timeout_s=0.5)
        if reply["held_blocks"] == before["held_blocks"] and reply["misses"] > before["misses"]:
            return reply  # one block was asked for, and there was none
        assert time.monotonic() < deadline, "the pool never filled its grant"


def test_pressure_moves_memory_from_an_idle_pool_to_a_bursting_one(shared_gpu, pools, sampler_for):
    broker, usage = shared_gpu("2GiB")
    with sampler_for(broker, usage) as sampler:
        a = pools(broker, usage, 2 * GIB, "model-a")
        first = a.request("fill", blocks=5500)
        assert first["held_blocks"] == 5500
        a.request("cache", blocks=5500)  # its requests finish; the prefix cache keeps every block
        granted_a = a.pool()["granted_bytes"]
        assert granted_a >= pages_of(5500) * POOL_PAGE_BYTES > GIB  # above its fair share (1 GiB)

        free_before = broker.status()["free_bytes"]  # A alone: no watermark frees anything for B yet
        b = pools(broker, usage, 2 * GIB, "model-b")
        burst = b.request("fill", blocks=3500)
        assert burst["held_blocks"] == 3500
        # The room was A's: B holds more than was free (B may never have missed, its pool growing
        # ahead of need on what the broker's watermarks and pressure took back from A's cache).
        assert b.pool()["granted_bytes"] > free_before

        after_a = a.pool()
        assert after_a["pressure_asks"] >= 1 and after_a["pages_released"] > 0
        assert after_a["granted_bytes"] < granted_a
        assert a.request("status")["cached_blocks"] == 0  # the eviction hook emptied A's prefix cache
        status = broker.status()
        (inst_a,) = [i for i in status["instances"] if i["name"] == "model-a"]
        assert inst_a["pressure"]["returned_bytes"] > 0
        assert session_of(status, "model-b")["granted_pages"] * (2 << 20) >= pages_of(3500) * POOL_PAGE_BYTES
    sampler.check()
    assert max(sampler.peak_mapped.values()) > GIB  # the samples saw the pools at their peaks


def test_a_kvctl_write_above_the_grant_is_an_operator_cap_not_a_licence(shared_gpu, pools, sampler_for):
    broker, usage = shared_gpu("2GiB")
    with broker.admin() as admin:
        admin.limit("model-a", max_bytes=512 * MIB)
    with sampler_for(broker, usage) as sampler:
        a = pools(broker, usage, 2 * GIB, "model-a")
        capped = fill_to_the_cap(a, broker)  # 3000 blocks (752 MiB) asked for, 512 MiB allowed
        assert capped["held_blocks"] < 3000 and capped["misses"] > 0  # misses, never an exception
        granted = a.pool()["granted_bytes"]
        assert 0 < granted <= 512 * MIB

        assert kvctl("limit", a.ipc_name, "4G").returncode == 0
        pool = wait_for(lambda: (lambda p: p if p["operator_cap_bytes"] == 4 * GIB else None)(a.pool()),
                        what="the governor to take the kvctl write as an operator cap")
        assert pool["limit_bytes"] <= granted
        again = fill_to_the_cap(a, broker)
        assert again["held_blocks"] == capped["held_blocks"]  # kvcached's sticky target stays hidden
        device = a.request("status")
        assert device["device_bytes"] - POOL_PAGE_BYTES <= 512 * MIB
        assert device["page_state"]["total_pages"] * POOL_PAGE_BYTES <= granted
        shown = wait_for(lambda: _segment_limit(a.ipc_name) == a.pool()["limit_bytes"] or None,
                         what="the segment to show the broker's limit again")
        assert shown

        # a cap below the grant lowers the limit: deferred while blocks are in use, released as they are freed
        assert kvctl("limit", a.ipc_name, "128M").returncode == 0
        wait_for(lambda: a.pool()["operator_cap_bytes"] == 128 * MIB, what="the lower cap")
        deferred = wait_for(lambda: (lambda p: p if p["pending_limit_bytes"] is not None else None)(a.pool()),
                            what="the lower limit to be deferred")
        # the record of why it could not give back at once (no prefix-cache hook is asked for a cap)
        assert deferred["blocked"].startswith("deferred: ") and "pages in use by blocks still allocated" \
            in deferred["blocked"] and deferred["deferred"] >= 1
        a.request("free", blocks=capped["held_blocks"])
        pool = wait_for(lambda: (lambda p: p if p["granted_bytes"] <= 128 * MIB else None)(a.pool()),
                        what="the pool to give back down to the cap")
        assert pool["limit_bytes"] <= 128 * MIB and pool["pages_released"] > 0
        assert wait_for(lambda: a.pool()["blocked"] == "" or None, what="the deferred limit to apply")
    sampler.check()


def test_the_pools_keep_within_their_grants_across_a_broker_restart(shared_gpu, pools, sampler_for):
    broker, usage = shared_gpu("2GiB")
    with sampler_for(broker, usage) as sampler:
        a = pools(broker, usage, 2 * GIB, "model-a")
        b = pools(broker, usage, 2 * GIB, "model-b")
        assert a.request("fill", blocks=2000)["held_blocks"] == 2000
        assert b.request("fill", blocks=2000)["held_blocks"] == 2000
        before, first_pid = sampler.samples, broker.status()["broker"]["pid"]
        broker.kill()
        grown: dict = {}
        filler = threading.Thread(target=lambda: grown.update(a.request("fill", blocks=4000)))
        filler.start()  # A needs more while the broker is gone: its governor waits for it
        broker.start()
        filler.join(timeout=60)
        assert grown.get("held_blocks") == 4000
        b.request("free", blocks=2000)
        for pool in (a, b):
            pool.request("settle")
        status = wait_for(lambda: _books_agree(broker, {"model-a": a, "model-b": b}), what="the books to agree")
        assert status["broker"]["pid"] != first_pid  # a new broker, from the old one's journal
        assert sampler.samples > before
    sampler.check()


def test_a_pool_whose_first_grant_is_refused_or_small_starts_within_its_grant(shared_gpu, pools, sampler_for):
    """The first grant refused: the pool starts empty, its null block waits, and the governor's
    retries grow the allocator itself (before kvcached's post-init); then a grant smaller than
    the null block's page and kvcached's 5-page reserve.  Mapped <= granted from the start."""
    broker, usage = shared_gpu("2GiB")
    with broker.admin() as admin:
        admin.limit("model-a", max_bytes=0)
    with sampler_for(broker, usage) as sampler:
        a = pools(broker, usage, 2 * GIB, "model-a", wait=False)
        err = usage.parent / "model-a.err"
        wait_for(lambda: "event=kvcached_pool_refused" in err.read_text(), what="the first grant to be refused")
        assert sampler.samples > 0
        with broker.admin() as admin:
            admin.limit("model-a", max_bytes=4 * POOL_PAGE_BYTES)  # the zero page and three pages at most
        ready = a.wait_ready()
        pool = ready["pools"][0]
        assert pool["governed"] and 1 <= pool["granted_bytes"] // POOL_PAGE_BYTES < 1 + 5
        assert ready["page_state"]["inuse_pages"] == 1  # the null block, on page 0
        assert (ready["page_state"]["inuse_pages"] + ready["page_state"]["reserved_pages"]) * POOL_PAGE_BYTES \
            <= pool["granted_bytes"]
        with broker.admin() as admin:
            admin.limit("model-a", max_bytes=None)
        assert a.request("fill", blocks=1000)["held_blocks"] == 1000  # grows as usual from there
        assert "Traceback" not in err.read_text()
    sampler.check()


def test_a_pool_process_patched_by_the_pth_hook_is_governed(shared_gpu, pools, sampler_for):
    """``ENABLE_KVCACHED=1`` alone: the package's ``.pth`` hook registers the patch at interpreter
    start, and kvcached's integration is then patched on import, with no explicit call."""
    broker, usage = shared_gpu("2GiB")
    with sampler_for(broker, usage) as sampler:
        a = pools(broker, usage, 2 * GIB, "model-a", extra_env={"ENABLE_KVCACHED": "1"})
        assert a.request("fill", blocks=1000)["held_blocks"] == 1000
        pool = a.pool()
        assert pool["governed"] and pool["granted_bytes"] >= pages_of(1000) * POOL_PAGE_BYTES
        err = (usage.parent / "model-a.err").read_text()
        assert "event=adapter_active" in err and "hook=pth" in err and "hook=explicit" not in err
    sampler.check()


def test_pages_a_restarted_broker_no_longer_charges_go_back_and_are_never_mapped(shared_gpu, pools):
    """The broker restarts without its state, its budget now about what the pool's process uses:
    the pool's re-assertion comes back short (the client books the rest as uncharged).  The pool
    gives those pages back and maps nothing beyond what the broker charges, although the device
    has room, and its grant ends up what the broker charges."""
    broker, usage = shared_gpu("2GiB")
    a = pools(broker, usage, 2 * GIB, "model-a")
    assert a.request("fill", blocks=1000)["held_blocks"] == 1000
    assert a.request("settle")["settled"]
    before = a.request("status")
    granted = before["pools"][0]["granted_bytes"]
    assert granted >= before["device_bytes"] + 8 * POOL_PAGE_BYTES  # grown ahead of need
    broker.kill()
    shutil.rmtree(broker.state_dir)  # its state is lost: the session must be re-asserted
    broker.extra_args[broker.extra_args.index("--headroom") + 1] = str(2 * GIB - before["device_bytes"])
    broker.start()

    def charged() -> int:
        return session_of(broker.status(), "model-a")["granted_pages"] * (2 << 20)

    def given_back() -> dict | None:
        # The limit is lowered first and the pages released after, in a second step; the figures
        # are read between the two now and then, so wait for both.
        p = a.pool()
        lowered = p["pressure_asks"] and p["limit_bytes"] <= charged()
        return p if lowered and p["granted_bytes"] <= p["limit_bytes"] else None

    lowered = wait_for(given_back, what="the pool to give back what the restarted broker does not charge")
    assert lowered["granted_bytes"] < granted
    more = a.request("fill", blocks=2000, stall_s=1.0)  # the device has room; the broker does not
    assert more["held_blocks"] < 2000 and more["misses"] > 0
    assert a.pool()["mapped_bytes"] <= charged()
    a.request("free", blocks=more["held_blocks"])
    status = wait_for(lambda: _books_agree(broker, {"model-a": a}),
                      what="the pool to hold what the restarted broker charges")
    assert session_of(status, "model-a")["granted_pages"] * (2 << 20) < granted
    err = (usage.parent / "model-a.err").read_text()
    assert "event=kvcached_uncharged_pages" in err and "event=unprotected" not in err


def test_without_a_broker_the_pool_runs_as_kvcached_alone(short_tmp, pools):
    nowhere = SimpleNamespace(endpoint=f"ipc://{short_tmp}/none.sock")
    usage = short_tmp / "gpu-usage"
    a = pools(nowhere, usage, 2 * GIB, "model-a", extra_env={"KVCACHED_BROKER_TIMEOUT_S": "1"})
    assert a.request("fill", blocks=3000)["held_blocks"] == 3000
    pool = a.pool()
    assert pool["governed"] is False and "unprotected" in pool["why_ungoverned"]
    a.stop()
    err = (usage.parent / "model-a.err").read_text()
    assert err.count("event=unprotected") == 1
    assert "Traceback" not in err


def test_a_pool_without_a_broker_gives_its_oldest_cached_pages_back_to_the_device(short_tmp, pools):
    """The hand-over benchmark's oracle (``give``): the oldest cached blocks are freed, the
    limit falls to the pages still in use and kvcached's reserve is trimmed, so the device has
    at least the pages freed back, and nothing maps them again."""
    nowhere = SimpleNamespace(endpoint=f"ipc://{short_tmp}/none.sock")
    a = pools(nowhere, short_tmp / "gpu-usage", 2 * GIB, "model-a", extra_env={"KVCACHED_BROKER_TIMEOUT_S": "1"})
    held = a.request("fill", blocks=20 * BLOCKS_PER_PAGE)["held_blocks"]
    a.request("cache", blocks=held)
    before = a.request("status")
    given = a.request("give", blocks=8 * BLOCKS_PER_PAGE, page_bytes=POOL_PAGE_BYTES)
    assert given["freed_blocks"] == 8 * BLOCKS_PER_PAGE
    inuse_pages = a.request("status")["page_state"]["inuse_pages"]
    assert given["limit"]["limit_bytes"] == inuse_pages * POOL_PAGE_BYTES
    assert given["limit"]["status"] == "applied"  # not deferred behind a reserve page mapped meanwhile
    assert before["device_bytes"] - given["device_bytes"] >= 8 * POOL_PAGE_BYTES
    after = a.request("status")
    assert after["device_bytes"] == given["device_bytes"]  # the reserve was not mapped again
    assert after["page_state"]["reserved_pages"] == 0
    assert after["cached_blocks"] == held - 8 * BLOCKS_PER_PAGE
    assert after["held_blocks"] == 0


def test_a_pool_following_a_trace_gives_at_its_instant_and_grows_again_after(short_tmp, pools):
    """The trace oracle's lender (``track`` with ``gives``): at the give's instant the oldest
    cached blocks go back to the device, unmapped; then the limit is what it was, so the pool
    maps again past what it kept."""
    nowhere = SimpleNamespace(endpoint=f"ipc://{short_tmp}/none.sock")
    a = pools(nowhere, short_tmp / "gpu-usage", 2 * GIB, "model-a", extra_env={"KVCACHED_BROKER_TIMEOUT_S": "1"})
    held = a.request("fill", blocks=20 * BLOCKS_PER_PAGE)["held_blocks"]
    a.request("cache", blocks=held)
    before = a.request("status")
    tracked = a.request("track", schedule=[[0.0, 0], [0.1, 0]], start_at=time.time(), sample_s=0.05,
                        gives=[[0.0, 8 * BLOCKS_PER_PAGE, POOL_PAGE_BYTES]])
    # Read once the pages were unmapped, before the limit went back up: after it, kvcached's
    # prealloc thread may map its reserve again before the first sample is read.
    (at_s, freed_blocks, gave_device_bytes), = tracked["gave"]
    assert at_s == tracked["samples"][0][0] and freed_blocks == 8 * BLOCKS_PER_PAGE
    assert before["device_bytes"] - gave_device_bytes >= 8 * POOL_PAGE_BYTES
    after = a.request("status")
    assert after["cached_blocks"] == held - 8 * BLOCKS_PER_PAGE
    assert after["limit"]["effective_limit_bytes"] == before["limit"]["current_capacity_bytes"]  # lifted back
    grown = a.request("fill", blocks=24 * BLOCKS_PER_PAGE, reuse_cache=True)
    assert grown["held_blocks"] == 24 * BLOCKS_PER_PAGE  # past the pages it kept: the limit is back


def _segment_limit(ipc_name: str) -> int | None:
    import json

    listed = kvctl("list", ipc_name, "--json")
    rows = json.loads(listed.stdout or "[]")
    return rows[0]["limit_bytes"] if rows else None


def _books_agree(broker, pools: dict) -> dict | None:
    """The broker's granted pages are what each governor holds (session pages of 2 MiB)."""
    status = broker.status()
    for name, pool in pools.items():
        if session_of(status, name)["granted_pages"] * (2 << 20) != pool.pool()["granted_bytes"]:
            return None
    return status


def _charges(status: dict) -> dict:
    """What a failure says: the budget, and each session's charge and its parts (bytes; pages)."""
    return {"budget": status["budget_bytes"], "free": status["free_bytes"], "sessions": [
        {k: s[k] for k in ("reserved_bytes", "granted_bytes", "measured_bytes", "unmapped_pages", "granted_pages")}
        | {"charged": i["charged_bytes"], "instance": i["name"]} for i in status["instances"] for s in i["sessions"]]}


def test_memory_taken_outside_a_pool_after_it_started_never_hides_in_its_unmapped_pages(shared_gpu, pools):
    """The whole-footprint issue's kvcached case.  On a 4 GiB device, A's pool grows ahead of its
    need (granted pages not mapped yet), then A takes 384 MiB outside its pool (CUDA graphs,
    cached activations).  Were a granted page counted as mapped, the device's measurement of A
    would hide the 384 MiB inside the unmapped grant, B would be granted memory that is
    physically taken, and 24 pages of A's grant could never be mapped.  The broker charges
    unmapped pages as promised memory: B gets only what is really free, and A maps its whole
    grant."""
    broker, usage = shared_gpu("4GiB")
    a = pools(broker, usage, 4 * GIB, "model-a")
    a.request("fill", blocks=1000)
    a.request("settle")
    grown = a.pool()
    assert grown["granted_bytes"] >= grown["mapped_bytes"] + 4 * POOL_PAGE_BYTES  # grown ahead of need
    with broker.admin() as admin:  # nobody may ask A for its grant back: the case is about B's room
        admin.limit("model-a", min_bytes=session_of(broker.status(), "model-a")["reserved_bytes"]
                    + grown["granted_bytes"] + GIB)
    outside = a.request("outside", bytes=384 * MIB)
    assert "oom" not in outside
    wait_for(lambda: session_of(broker.status(), "model-a")["measured_bytes"] >= outside["device_bytes"],
             what="the broker's probe to read A's usage, as it reads NVML")
    b = pools(broker, usage, 4 * GIB, "model-b")
    b.request("fill", blocks=100_000, stall_s=1.0)  # B takes every page the broker grants it
    a.request("settle")
    held = a.pool()
    with allocation_lock(usage):  # nothing maps meanwhile: the device's free room against A's unmapped grant
        free_bytes = 4 * GIB - sum(read_shared_usage(usage).values())
    assert free_bytes >= held["limit_bytes"] - held["mapped_bytes"] >= 4 * POOL_PAGE_BYTES
    a.request("fill", blocks=100_000, stall_s=1.0)  # A maps every page of its grant
    a.request("settle")
    filled = a.pool()
    assert filled["mapped_bytes"] >= filled["limit_bytes"] - POOL_PAGE_BYTES
    # A page A mapped since the broker's last reading of the device is charged twice (measured and
    # promised) until A's next mapped report, so the flag may be up for a moment; B holding memory
    # that A's grant needs would keep it up.
    deadline_s = time.monotonic() + 60  # bounds a failure only
    while (status := broker.status())["overcommitted"]:
        assert time.monotonic() < deadline_s, f"overcommitted for 60 s: {_charges(status)}"
        time.sleep(0.05)
    # B's asks may take A's idle pages back meanwhile (its floor is below what it now holds), so the
    # broker's ledger is held against the governor's book read at the same moment, not against `filled`.
    agreed = wait_for(lambda: _books_agree(broker, {"model-a": a}),
                      what="the broker's ledger to hold the grant A's governor holds")
    assert session_of(agreed, "model-a")["report_mapping"]
