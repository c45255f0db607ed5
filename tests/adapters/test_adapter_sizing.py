"""The one sizing algorithm both runtimes start with (adapters/sizing.py), against a real broker
on a simulated device that measures this process as NVML would.

A start-up is admitted in one request: the base pinned, the runtime's slack held in full, the
KV cache held as much as fits between the least it needs and its own figure.  The pools then
turn the KV hold into ``kv_static`` (a padded pool eats into the slack hold), and the end of the
warm-up pins the base where the device measures it and keeps the slack the warm-up did not
allocate as ``runtime_slack``.  At no step does the charge leave room for a neighbour that
the device does not have.
"""

from __future__ import annotations

import logging
import os
import threading

import pytest

from helpers import GIB, MIB, Worker

from kvcached_broker.adapters import announce, handback, process_state, sessions, sizing
from kvcached_broker.adapters.report_book import KV_SIZING_HOLD, SLACK_HOLD, SLACK_POOL
from kvcached_broker.adapters.worker_identity import WorkerIdentity
from kvcached_broker.client.admin import AdminClient

PID = os.getpid()
ME = WorkerIdentity("sglang", "cpu", instance="me")


@pytest.fixture
def device(adapter_broker):
    """``set(bytes)``: what the simulated device measures this process using (weights 2 GiB now)."""
    def measure(size_bytes: int) -> None:
        with AdminClient(adapter_broker.endpoint, timeout_s=30) as admin:
            admin.simulate(process_bytes={PID: size_bytes})

    measure(2 * GIB)
    return measure


@pytest.fixture
def neighbour(adapter_broker, workers):
    """``hold(bytes)``: another server's process, holding that much as its pools."""
    def hold(size_bytes: int) -> None:
        workers.append(Worker(adapter_broker.endpoint, "neighbour", {"other": size_bytes}, 0))

    return hold


def _me(broker) -> dict:
    session_id = sessions.session(ME).client.session_id
    (found,) = [s for i in broker.status()["instances"] for s in i["sessions"] if s["id"] == session_id]
    return found


def test_the_slack_is_held_in_full_and_the_kv_cache_as_much_as_fits(adapter_broker, device, neighbour):
    neighbour(3 * GIB)  # 10 GiB: 2 of weights, 3 elsewhere, 5 free
    sized = sizing.size(ME, sizing.StartupAsk("SGLang", 8 * GIB, GIB, GIB))
    assert (sized.kv_bytes, sized.slack_bytes) == (4 * GIB, GIB)
    assert sized.holders == (("neighbour", 3 * GIB),) and sized.ever_bytes == 10 * GIB - 7 * GIB
    me = _me(adapter_broker)
    assert me["holds"] == {KV_SIZING_HOLD: 4 * GIB, SLACK_HOLD: GIB} and me["pools"]["runtime_base"] == 2 * GIB
    assert me["phase"] == "sizing" and adapter_broker.status()["free_bytes"] == 0


def test_a_start_up_whose_least_does_not_fit_fails_in_one_line_naming_the_broker_and_the_holders(
        adapter_broker, device, neighbour):
    neighbour(6 * GIB)  # 2 GiB free
    with pytest.raises(sizing.StartupRefused) as refused:
        sizing.size(ME, sizing.StartupAsk("vLLM", 8 * GIB, 2 * GIB, GIB))
    message = str(refused.value)
    assert adapter_broker.endpoint in message and "'me'" in message and "\n" not in message
    assert "a KV cache of up to 8.00 GiB (at least 2.00 GiB) and 1.00 GiB beside it" in message
    assert "asked 3.00 GiB, 2.00 GiB free" in message and "held by neighbour 6.00 GiB" in message
    assert _me(adapter_broker)["holds"] == {}  # nothing held


def test_kvcached_mode_holds_the_slack_and_caps_the_virtual_size_at_what_could_ever_be_given(
        adapter_broker, device, neighbour):
    with adapter_broker.admin() as admin:
        admin.limit("neighbour", min_bytes=3 * GIB)
    neighbour(GIB)
    sized = sizing.size(ME, sizing.StartupAsk("SGLang", 72 * GIB, 1, GIB, elastic=True))
    assert sized.kv_bytes == 10 * GIB - 3 * GIB - (2 * GIB + GIB)  # the floor, the weights, the slack
    assert _me(adapter_broker)["holds"] == {SLACK_HOLD: GIB}


def test_a_pool_padded_past_the_kv_hold_takes_the_rest_out_of_the_slack_in_the_same_request(
        adapter_broker, device, neighbour):
    sizing.size(ME, sizing.StartupAsk("SGLang", 4 * GIB, 1, GIB))
    free = adapter_broker.status()["free_bytes"]
    pool_bytes = 4 * GIB + 24 * MIB  # SGLang's size + page_size rows
    session = sessions.session(ME)
    assert session.book.holds_after_pool(pool_bytes, last=True) == {KV_SIZING_HOLD: 0, SLACK_HOLD: GIB - 24 * MIB}
    session.report_built("pool", {"kv_static": pool_bytes}, last=True)
    assert session.book.holds == {SLACK_HOLD: GIB - 24 * MIB}
    assert adapter_broker.status()["free_bytes"] == free  # the charge did not move: no room to find


def test_the_end_of_the_warm_up_pins_the_base_and_keeps_the_slack_it_did_not_allocate(
        adapter_broker, device, neighbour):
    sizing.size(ME, sizing.StartupAsk("SGLang", 4 * GIB, 1, GIB))
    sessions.session(ME).report_built("pool", {"kv_static": 4 * GIB}, last=True)
    device(6 * GIB + 384 * MIB)  # the pool, and 384 MiB of CUDA graphs and cached activations
    before = _charged(adapter_broker)  # 6.375 measured + the 1 GiB slack hold on top
    assert sessions.session(ME).settle_warm_up() == GIB - 384 * MIB
    me = _me(adapter_broker)
    assert me["holds"] == {} and me["phase"] == "serving"
    assert me["pools"] == {"runtime_base": 2 * GIB + 384 * MIB, "kv_static": 4 * GIB, SLACK_POOL: GIB - 384 * MIB}
    assert _charged(adapter_broker) == before - 384 * MIB  # the graphs are no longer counted twice
    device(7 * GIB)  # a long prefill's activations later: inside the slack kept, nothing unreported
    assert adapter_broker.status()["unreported_bytes"] == 0


def _charged(broker) -> int:
    return sum(i["charged_bytes"] for i in broker.status()["instances"])


class _Said(logging.Filter):
    """Sets ``event`` when an adapter line carrying ``marker`` is written (adapters/announce.py)."""

    def __init__(self, marker: str):
        super().__init__()
        self.marker, self.event, self.lines = marker, threading.Event(), []

    def filter(self, record: logging.LogRecord) -> bool:
        line = record.getMessage()
        if self.marker in line:
            self.lines.append(line)
            self.event.set()
        return True


@pytest.fixture
def waiting_said():
    said = _Said("event=startup_waiting")
    announce.handler().addFilter(said)
    yield said
    announce.handler().removeFilter(said)


def test_a_start_up_refused_while_a_neighbour_starts_waits_for_it_and_is_admitted_as_if_it_came_after(
        adapter_broker, device, workers, waiting_said):
    # the neighbour between allocating its pool and reporting it: its 6 GiB KV hold is charged on
    # top of what it measures (the pool, 3 GiB of it allocated); 10 - 2 - 3 - 6 leaves nothing
    workers.append(Worker(adapter_broker.endpoint, "neighbour", {}, 0))
    neighbour = workers[-1]
    neighbour.reserve({"weights": GIB}, holds={KV_SIZING_HOLD: 6 * GIB}, phase="sizing")
    with AdminClient(adapter_broker.endpoint, timeout_s=30) as admin:
        admin.simulate(process_bytes={PID: 2 * GIB, neighbour.proc.pid: 4 * GIB})
    outcome: dict = {}

    def start() -> None:
        try:
            outcome["sized"] = sizing.size(ME, sizing.StartupAsk("SGLang", 8 * GIB, 1, GIB))
        except Exception as exc:  # noqa: BLE001 - the test reads it
            outcome["error"] = exc

    thread = threading.Thread(target=start)
    thread.start()
    assert waiting_said.event.wait(60), outcome
    assert "for=neighbour" in waiting_said.lines[0] and "start-ups in progress hold 6.00 GiB" in waiting_said.lines[0]
    # its pool reported: the hold turns into kv_static (3 GiB) and the double count ends
    neighbour.reserve({"weights": GIB, "kv_static": 3 * GIB}, holds={}, phase="warming")
    thread.join(60)
    assert not thread.is_alive() and "error" not in outcome, outcome
    sized = outcome["sized"]
    assert (sized.kv_bytes, sized.slack_bytes) == (10 * GIB - 2 * GIB - 4 * GIB - GIB, GIB)
    assert sized.holders == (("neighbour", 4 * GIB),)


def test_a_refusal_with_no_start_up_in_progress_does_not_wait(adapter_broker, device, neighbour, waiting_said):
    neighbour(7 * GIB)  # pools, no holds: nothing will come back by waiting
    with pytest.raises(sizing.StartupRefused) as refused:
        sizing.size(ME, sizing.StartupAsk("SGLang", 8 * GIB, 1, 2 * GIB))
    assert not waiting_said.lines and "start-ups in progress" not in str(refused.value)


def test_with_no_wait_a_refusal_names_the_start_ups_in_progress_at_once(
        adapter_broker, device, workers, waiting_said, monkeypatch):
    monkeypatch.setenv(sizing.STARTUP_WAIT_ENV, "0")
    workers.append(Worker(adapter_broker.endpoint, "neighbour", {}, 0))
    workers[-1].reserve({}, holds={SLACK_HOLD: 7 * GIB}, phase="warming")
    with pytest.raises(sizing.StartupRefused) as refused:
        sizing.size(ME, sizing.StartupAsk("SGLang", 8 * GIB, 1, 2 * GIB))
    message = str(refused.value)
    assert "start-ups in progress hold 7.00 GiB (neighbour)" in message and "\n" not in message
    assert _me(adapter_broker)["holds"] == {}


@pytest.mark.parametrize("raw", ["-1", "soon", "inf", "nan"])
def test_a_bad_start_up_wait_is_one_line_naming_the_variable(raw):
    with pytest.raises(sizing.StartupRefused, match=f"^{sizing.STARTUP_WAIT_ENV}=.* is not a number of seconds"):
        sizing.startup_wait_s({sizing.STARTUP_WAIT_ENV: raw})
    assert sizing.startup_wait_s({sizing.STARTUP_WAIT_ENV: " 2.5 "}) == 2.5
    assert sizing.startup_wait_s({}) == sizing.DEFAULT_STARTUP_WAIT_S


def _serving_after_warm_up(broker) -> int:
    """Sized, the pool built, warmed up (384 MiB of graphs and activations): free bytes then."""
    sizing.size(ME, sizing.StartupAsk("SGLang", 4 * GIB, 1, GIB))
    sessions.session(ME).report_built("pool", {"kv_static": 4 * GIB}, last=True)
    _measure(broker, 6 * GIB + 384 * MIB)
    assert sessions.session(ME).settle_warm_up() == GIB - 384 * MIB
    return broker.status()["free_bytes"]


def _measure(broker, size_bytes: int) -> None:
    with AdminClient(broker.endpoint, timeout_s=30) as admin:
        admin.simulate(process_bytes={PID: size_bytes})


def test_a_re_pin_after_the_warm_up_keeps_the_slack_not_allocated_yet(adapter_broker, device):
    free = _serving_after_warm_up(adapter_broker)
    handback.before_release(ME, {"weights", "kv_cache"})  # SGLang's release pins the base first
    assert adapter_broker.status()["free_bytes"] == free  # it once gave the 640 MiB kept away
    assert _me(adapter_broker)["pools"][SLACK_POOL] == GIB - 384 * MIB


def test_a_re_pin_moves_activations_the_device_measures_from_the_slack_into_the_base(adapter_broker, device):
    free = _serving_after_warm_up(adapter_broker)
    _measure(adapter_broker, 6 * GIB + 512 * MIB)  # 128 MiB more cached activations, inside the slack
    sessions.session(ME).repin_base()
    me = _me(adapter_broker)
    assert me["pools"]["runtime_base"] == 2 * GIB + 512 * MIB and me["pools"][SLACK_POOL] == GIB - 512 * MIB
    assert adapter_broker.status()["free_bytes"] == free  # nothing given away, nothing counted twice
    sessions.session(ME).report("pool", {"kv_static": 4 * GIB})  # the adapter's book follows the broker's slack
    assert _me(adapter_broker)["pools"][SLACK_POOL] == GIB - 512 * MIB


def test_a_release_and_resume_cycle_keeps_the_slack_for_a_later_prefill(adapter_broker, device):
    free = _serving_after_warm_up(adapter_broker)
    tags = {"weights", "kv_cache"}
    handback.before_release(ME, tags)
    _measure(adapter_broker, 384 * MIB)  # weights and KV handed back
    handback.after_release(ME, tags, ["pool"])
    handback.admit(ME, tags, ["pool"])
    _measure(adapter_broker, 6 * GIB + 384 * MIB)  # mapped again
    handback.settle(ME, tags)
    assert adapter_broker.status()["free_bytes"] == free
    _measure(adapter_broker, 7 * GIB)  # a long prefill inside the slack it was promised
    assert adapter_broker.status()["unreported_bytes"] == 0


def test_a_pool_refused_a_little_past_its_hold_says_how_little(adapter_broker, device):
    from kvcached_broker.adapters.sglang import kv_budget, reporting

    with adapter_broker.admin() as admin:
        admin.limit("me", max_bytes=6 * GIB)
    sizing.size(ME, sizing.StartupAsk("SGLang", 8 * GIB, 1, 0))  # the KV held up to the cap: 4 GiB

    class Pool:
        pass

    with pytest.raises(kv_budget.BrokerBudgetError) as refused:
        reporting.report_pool(ME, Pool(), "kv_static", {"kv_static": 4 * GIB + 13 * 1024}, "its static KV pool",
                              last=True)
    assert "cannot give SGLang instance 'me' 13.00 KiB more for its static KV pool" in str(refused.value)


def test_the_governors_run_a_round_before_the_end_of_the_warm_up_pins_the_base(
        adapter_broker, device, neighbour):
    """kvcached mode: :mod:`.kvcached.runner` has the worker let its governors run a round (and
    report what they mapped) before the base is pinned where the device measures it, or the base
    would count those pages.  The runner steps only when woken here, so the round that moved the
    measurement can only be the one settle_warm_up asked for."""
    from kvcached_broker.adapters.kvcached import runner

    class Reporting:
        """A governor whose armed round reports 384 MiB it mapped (the device measures them)."""
        key = "test-pool"
        armed = False

        def step(self, now: float) -> None:
            if self.armed:
                self.armed = False
                device(6 * GIB + 384 * MIB)

    sizing.size(ME, sizing.StartupAsk("SGLang", 4 * GIB, 1, GIB))
    sessions.session(ME).report_built("pool", {"kv_static": 4 * GIB}, last=True)
    device(6 * GIB)
    tick_s = runner.TICK_S
    runner.TICK_S = 3600.0
    governor = Reporting()
    try:
        runner.enlist(governor)
        runner.enlist(governor)
        assert sessions.registry().before_settling_steps.count(runner._report_mapped) == 1  # registered once
        assert runner.settle(1, timeout_s=30)  # the round enlisting woke is over
        governor.armed = True
        assert sessions.session(ME).settle_warm_up() == GIB - 384 * MIB  # the round ran first: the base took it
        assert not governor.armed
    finally:
        runner.TICK_S = tick_s
        del governor
        runner.wake()


def test_resetting_the_worker_forgets_what_was_handed_back(adapter_broker, device):
    """:mod:`.handback` keeps its ledger in the process registry, which :func:`.process_state.reset`
    resets (the worker does not import it): after a reset nothing handed back before is left."""
    _serving_after_warm_up(adapter_broker)
    tags = {"weights", "kv_cache"}
    handback.before_release(ME, tags)
    _measure(adapter_broker, 384 * MIB)
    handback.after_release(ME, tags, ["pool"])
    assert handback.handed_back(ME)
    process_state.reset()
    assert not handback.handed_back(ME)
