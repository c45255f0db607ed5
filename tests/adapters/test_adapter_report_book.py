"""adapters/report_book.py: the book a worker sends its broker, with no I/O (rules B1-B7)."""

from __future__ import annotations

from kvcached_broker.adapters.report_book import KV_SIZING_HOLD, RUNTIME_BASE_POOL, SLACK_HOLD, SLACK_POOL, ReportBook

GIB = 1 << 30


def _answered(book: ReportBook, plan, *, base_bytes: int = 0, answer=None, holds=None) -> dict:
    """The broker answers ``plan`` with what it was sent (plus the base it pinned)."""
    request = book.request(plan)
    charged = dict(request.pools if answer is None else answer)
    if plan.pin_base:
        charged[RUNTIME_BASE_POOL] = base_bytes
    book.took(plan, request, charged, charged.get(RUNTIME_BASE_POOL, 0), holds=holds)
    return charged


def test_reports_replace_only_their_own_entry_and_are_summed_pool_by_pool():
    book = ReportBook()
    first = book.report("a", {"kv": 2 * GIB, "swa": 0}, {"view": GIB}, None, None)
    assert first.pin_base and book.request(first).pools == {"kv": 2 * GIB}  # B2: the pin sends no base
    _answered(book, first, base_bytes=5 * GIB)
    assert book.base_bytes == 5 * GIB
    second = book.report("b", {"kv": GIB}, None, None, "warming")
    request = book.request(second)
    assert request.pools == {"kv": 3 * GIB, RUNTIME_BASE_POOL: 5 * GIB} and request.usage == {"view": GIB}
    _answered(book, second)
    again = book.report("a", {"c4": GIB}, None, None, None)  # a's entry replaced, b's kept
    assert book.request(again).pools == {"c4": GIB, "kv": GIB, RUNTIME_BASE_POOL: 5 * GIB}
    assert book.phase == "warming"


def test_a_plan_changes_nothing_until_the_broker_answered_it():
    book = ReportBook()
    _answered(book, book.report("a", {"kv": GIB}, None, {"hold": GIB}, None), base_bytes=GIB)
    plan = book.report("a", {"kv": 9 * GIB}, None, {"hold": 0}, "serving")  # refused: never taken
    assert plan.book["a"] == {"kv": 9 * GIB} and plan.holds == {}
    assert book.book == {"a": {"kv": GIB}} and book.holds == {"hold": GIB} and book.phase == ""


def test_holds_change_by_name_and_a_shrunk_hold_books_what_the_broker_granted():
    book = ReportBook()
    plan = book.hold("kv_sizing", 4 * GIB)
    assert plan is not None and plan.pin_base
    _answered(book, plan, base_bytes=GIB)
    assert book.hold("kv_sizing", 4 * GIB) is None  # nothing changes: no request
    fits = book.hold_what_fits({"slack": 2 * GIB}, {"kv_sizing": GIB}, "sizing")
    assert fits.holds == {"kv_sizing": 4 * GIB, "slack": 2 * GIB} and fits.min_holds == {"kv_sizing": GIB}
    _answered(book, fits, holds={"kv_sizing": 3 * GIB, "slack": 2 * GIB})
    assert book.holds == {"kv_sizing": 3 * GIB, "slack": 2 * GIB} and book.held_bytes() == 5 * GIB


def test_a_built_pool_shrinks_the_kv_hold_by_its_growth_and_takes_what_is_beyond_out_of_the_slack():
    """B6: a pool the KV hold was for shrinks it by its growth (the last drops it); growth past
    the KV hold comes out of the slack hold; with no hold there is nothing to change."""
    book = ReportBook()
    assert book.holds_after_pool(GIB, last=False) is None
    _answered(book, book.hold_what_fits({KV_SIZING_HOLD: 4 * GIB, SLACK_HOLD: GIB}, None, "sizing"), base_bytes=GIB)
    assert book.holds_after_pool(3 * GIB, last=False) == {KV_SIZING_HOLD: GIB}
    assert book.holds_after_pool(3 * GIB, last=True) == {KV_SIZING_HOLD: 0}
    assert book.holds_after_pool(-GIB, last=False) == {KV_SIZING_HOLD: 4 * GIB}  # a pool that shrank: no change
    padded = book.holds_after_pool(4 * GIB + (256 << 20), last=True)
    assert padded == {KV_SIZING_HOLD: 0, SLACK_HOLD: GIB - (256 << 20)}
    assert book.holds_after_pool(6 * GIB, last=True) == {KV_SIZING_HOLD: 0, SLACK_HOLD: 0}  # never below 0


def test_suspended_reporters_stay_in_the_book_uncharged_until_resumed():
    book = ReportBook()
    _answered(book, book.report("weights", {"w": 4 * GIB}, {"v": GIB}, None, None), base_bytes=2 * GIB)
    _answered(book, book.report("kv", {"kv": 8 * GIB}, None, None, None))
    plan, freed = book.suspend(["kv", "unknown"], base_bytes=GIB)
    assert freed == 8 * GIB + GIB and book.request(plan).pools == {"w": 4 * GIB, RUNTIME_BASE_POOL: GIB}
    _answered(book, plan)
    assert book.suspended == {"kv"} and book.base_bytes == GIB and book.booked_bytes("kv") == 8 * GIB
    assert book.suspend(["kv"], None) is None  # suspended already
    plan, charged = book.resume(None, base_bytes=2 * GIB)
    assert charged == 8 * GIB + GIB and book.request(plan).pools[RUNTIME_BASE_POOL] == 2 * GIB
    _answered(book, plan)
    assert book.suspended == set() and book.resume(None, None) is None


def test_a_pin_that_moved_slack_into_the_base_books_the_slack_the_broker_kept():
    book = ReportBook()
    _answered(book, book.hold("slack", 2 * GIB), base_bytes=3 * GIB)
    _answered(book, book.keep_slack(2 * GIB, "slack"))
    assert book.book == {SLACK_POOL: {SLACK_POOL: 2 * GIB}} and book.holds == {} and book.phase == "serving"
    repin = book.repin(())
    _answered(book, repin, base_bytes=4 * GIB, answer={SLACK_POOL: GIB})  # activations grew the base by 1 GiB
    assert book.base_bytes == 4 * GIB and book.booked_bytes(SLACK_POOL) == GIB


def test_pages_are_counted_by_holder_and_a_dropped_reporter_leaves_nothing():
    book = ReportBook()
    assert book.count_mapped("pool-a", 5) == 5 and book.count_mapped("pool-b", 3) == 8
    assert book.count_mapped("pool-a", 0) == 3 and book.count_idle("pool-b", 2) == 2
    _answered(book, book.report("a", {"kv": GIB}, {"v": 1}, None, None), base_bytes=GIB)
    _answered(book, book.suspend(["a"], None)[0])
    book.drop("a")
    assert book.book == {} and book.usage == {} and book.suspended == set()
