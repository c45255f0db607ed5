"""The hand-over benchmark's trace oracle (``benchmarks/handover.py``, ``Trace.lender_gives``):
what each model gives back, and when, so that a rising model finds what it lacks."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "handover.py"


@pytest.fixture(scope="module")
def handover():
    spec = importlib.util.spec_from_file_location("handover_bench_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module's annotations through it
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def trace(handover, *models: tuple[str, tuple]) -> object:
    return handover.Trace("t", "test", tuple(handover.Model(name, steps) for name, steps in models), 10.0)


def room_gib(handover) -> float:
    return handover.USABLE_BYTES / handover.GIB


def test_a_rising_model_is_given_only_what_it_lacks_beyond_the_free_memory(handover):
    room = room_gib(handover)
    gives = trace(handover, ("A", ((0.0, 2), (1.0, room - 2), (2.0, 2))),
                  ("B", ((0.0, 2), (3.0, 30)))).lender_gives()
    # At 3 s: A has 2 live and room - 4 cached, B 2 live; free is 0, so B lacks 28 of A's cache.
    assert gives == {"A": [(3.0, pytest.approx(28.0))]}


def test_free_memory_and_the_own_cache_come_before_another_models_cache(handover):
    room = room_gib(handover)
    gives = trace(handover, ("A", ((0.0, 10), (1.0, 2))),
                  ("B", ((0.0, 10), (2.0, 4), (3.0, room - 8)))).lender_gives()
    # At 3 s: 2 + 8 cached for A, 4 + 6 cached for B, free room - 20; B needs room - 12:
    # the free memory, then its own 6 cached, then 2 of A's 8.
    assert gives == {"A": [(3.0, pytest.approx(2.0))]}
    assert trace(handover, ("A", ((0.0, 10), (1.0, 2))), ("B", ((0.0, 10), (3.0, 20)))).lender_gives() == {}


def test_the_oldest_cache_on_the_device_goes_first(handover):
    room = room_gib(handover)
    third = room / 3
    gives = trace(handover, ("A", ((0.0, third), (1.0, 0))),  # A's cache is the older
                  ("B", ((0.0, third), (2.0, 0))),
                  ("C", ((0.0, third), (3.0, room)))).lender_gives()
    assert gives == {"A": [(3.0, pytest.approx(third))], "B": [(3.0, pytest.approx(third))]}
    gives = trace(handover, ("A", ((0.0, third), (1.0, 0))),
                  ("B", ((0.0, third), (2.0, 0))),
                  ("C", ((0.0, third), (3.0, 1.5 * third)))).lender_gives()
    assert gives == {"A": [(3.0, pytest.approx(0.5 * third))]}  # none of B's: A's covered it


def test_a_model_given_away_and_back_follows_its_cache(handover):
    """The benchmark's ``three`` trace, step by step (room: 76 GiB of an 80 GiB device)."""
    gives = handover.TRACES["three"].lender_gives()
    room = room_gib(handover)
    assert room == pytest.approx(76.0)
    # 5 s: C rises to 40; A (5 live, 35 cached) and B (30) leave room - 75 free: A gives 34.
    # 12 s: A rises to 26 with 1 cached; B's cache (25, from 7 s) is older than C's (36).
    # 13 s: B rises to 22 with 5 of its own cached: C gives the other 12.
    assert gives == {"A": [(5.0, pytest.approx(34.0))], "B": [(12.0, pytest.approx(20.0))],
                     "C": [(13.0, pytest.approx(12.0))]}


def test_the_device_oracle_runs_only_where_the_demand_always_fits(handover):
    fits = {name: handover.trace_named(name).always_fits for name in ("burst", "overlap", "three")}
    assert fits == {"burst": True, "overlap": False, "three": True}


def test_models_rising_at_the_same_step_do_not_lend_to_each_other(handover):
    room = room_gib(handover)
    third = room / 3
    gives = trace(handover, ("A", ((0.0, third), (1.0, 0), (3.0, third + 5))),
                  ("B", ((0.0, third), (2.0, 0), (3.0, third + 5))),
                  ("C", ((0.0, third), (2.5, 0)))).lender_gives()
    # At 3 s each of A and B uses its own cache, then the free memory is gone: the 10 they
    # lack beyond it come from C's cache, however old A's and B's are.
    assert gives == {"C": [(3.0, pytest.approx(10.0))]}


def test_the_room_is_what_the_caller_says_the_kv_may_take(handover):
    gives = trace(handover, ("A", ((0.0, 40), (1.0, 0))), ("B", ((0.0, 0), (2.0, 40)))).lender_gives(room_gib=60.0)
    assert gives == {"A": [(2.0, pytest.approx(20.0))]}  # 60 - 40 cached = 20 free; B lacks 20


def test_a_traces_rises_are_its_models_rising_steps_each_until_the_models_next_rise(handover):
    t = trace(handover, ("A", ((0.0, 4), (1.0, 56), (5.0, 6), (9.0, 6), (13.0, 30))),
              ("B", ((0.0, 0), (6.0, 44), (12.0, 8))))
    assert t.rises() == [("A", 0.0, 1.0, 0.0, 4), ("A", 1.0, 13.0, 4, 56), ("A", 13.0, float("inf"), 6, 30),
                         ("B", 6.0, float("inf"), 0, 44)]


def samples(handover, *points: tuple[float, float, float]) -> dict:
    """A model's run: ``(t_s, demand GiB, live GiB)`` samples, as a pool's track reply gives them."""
    return {"samples": [[t, demand, live, 0.0, live] for t, demand, live in points]}


def test_the_unserved_demand_of_each_rise_sums_its_samples_shortfall_until_the_next_rise(handover):
    t = trace(handover, ("A", ((0.0, 4), (1.0, 56), (5.0, 6), (13.0, 30))))
    run = {"A": samples(handover,
                        (0.0, 4, 1), (0.95, 4, 4),  # the first rise: 3 GiB short in one sample
                        (1.0, 56, 10), (1.05, 56, 40), (1.1, 56, 56), (4.95, 56, 50),  # 46 + 16 + 6 short
                        (5.0, 6, 56),  # a fall: its finished requests stay cached
                        (5.05, 6, 3),  # a fall short all the same: the climb before it lost it
                        (13.0, 30, 20), (13.05, 30, 31))}  # the return: 10 short
    lost = handover.unserved_by_rise(t, run)
    step = handover.SAMPLE_S
    assert lost == {("A", 0.0): pytest.approx(3 * step), ("A", 1.0): pytest.approx(71 * step),
                    ("A", 13.0): pytest.approx(10 * step)}
    # What the model did not serve is the sum of its rises' losses.
    demand = sum(d for _, d, _, _, _ in run["A"]["samples"])
    served = sum(min(d, live) for _, d, live, _, _ in run["A"]["samples"])
    assert sum(lost.values()) == pytest.approx((demand - served) * step)


def test_the_table_shows_the_rises_where_kvcached_mode_lost_most_with_each_set_ups_loss(handover, monkeypatch):
    t = trace(handover, ("A", ((0.0, 4), (1.0, 56), (5.0, 6), (13.0, 30))), ("B", ((0.0, 4), (6.0, 44))))
    monkeypatch.setitem(handover.TRACES, "t", t)
    monkeypatch.setattr(handover, "RISES_SHOWN", 2)

    def result(a: tuple, b: tuple) -> dict:
        """One set-up's run of the trace: A and B short as ``(t_s, demand, live)`` samples say."""
        run = {"A": samples(handover, *a), "B": samples(handover, *b)}
        for name in run:
            points = run[name]["samples"]
            run[name]["served_gib_s"] = sum(min(d, live) for _, d, live, _, _ in points) * handover.SAMPLE_S
            run[name]["demand_gib_s"] = sum(d for _, d, _, _, _ in points) * handover.SAMPLE_S
        return {"trials": [], "traces": {"t": run}}

    broker = result(((0.0, 4, 4), (1.0, 56, 16), (13.0, 30, 10)), ((0.0, 4, 4), (6.0, 44, 3)))
    alone = result(((0.0, 4, 4), (1.0, 56, 46), (13.0, 30, 0)), ((0.0, 4, 4), (6.0, 44, 44)))
    alone["oracle_traces"] = {"t": result(((0.0, 4, 4), (1.0, 56, 56), (13.0, 30, 30)),
                                          ((0.0, 4, 4), (6.0, 44, 37)))["traces"]["t"]}
    summaries = {"alone": handover.summary(alone), "broker": handover.summary(broker)}
    shown = [r for r in handover.rows(summaries, ["t"]) if "unserved" in r["figure"]]
    # kvcached mode's largest (B at 6 s: 41 GiB short, A at 1 s: 40), not kvcached alone's (A at 13 s: 30).
    assert [r["figure"].strip() for r in shown] == ["GiB*s unserved: model-b rising 4->44 GiB at 6 s",
                                                    "GiB*s unserved: model-a rising 4->56 GiB at 1 s"]
    step = handover.SAMPLE_S
    assert shown[0]["values"] == {"alone": 0.0, "broker": pytest.approx(41 * step)}
    assert shown[0]["oracle"] == pytest.approx(7 * step)
    assert shown[1]["values"] == {"alone": pytest.approx(10 * step), "broker": pytest.approx(40 * step)}
    assert shown[1]["oracle"] == 0.0
    # Where kvcached mode did not run the trace, the first set-up that did orders them.
    summaries["broker"] = handover.summary({"trials": [], "traces": {}})
    assert [r[:2] for r in handover.largest_losses(summaries, "t", 2)] == [("A", 13.0), ("A", 1.0)]
    assert handover.largest_losses({}, "t", 2) == []


def test_a_rise_shows_fractional_gib_and_a_first_step_after_the_start(handover, monkeypatch):
    t = trace(handover, ("A", ((0.5, 10.125), (1.0, 10.8125))))
    monkeypatch.setitem(handover.TRACES, "t", t)
    run = {"A": samples(handover, (0.0, 0, 0), (0.45, 0, 0), (0.5, 10.125, 10), (1.0, 10.8125, 10))}
    run["A"].update(served_gib_s=0.0, demand_gib_s=1.0)
    assert t.rises() == [("A", 0.5, 1.0, 0.0, 10.125), ("A", 1.0, float("inf"), 10.125, 10.8125)]
    shown = [r["figure"].strip() for r in handover.rows({"broker": handover.summary({"trials": [], "traces": {"t": run}})},
                                                        ["t"]) if "unserved" in r["figure"]]
    assert shown == ["GiB*s unserved: model-a rising 10.12->10.81 GiB at 1 s",
                     "GiB*s unserved: model-a rising 0->10.12 GiB at 0.5 s"]


def test_a_runs_logs_are_kept_under_the_out_folder_replacing_an_earlier_runs(handover, tmp_path):
    work = tmp_path / "work"
    (work / "broker-2-0" / "gpu-usage").mkdir(parents=True)  # a rig's device: not a log
    (work / "broker-2-0-broker.log").write_text("event=pressure kind=watermark\n")
    (work / "broker-2-0-A.err").write_text("governor says\n")
    (work / "broker-2-0.sock.lock").write_text("")
    dest = tmp_path / "out" / "logs"
    dest.mkdir(parents=True)
    (dest / "stale-broker.log").write_text("an earlier run's\n")
    (dest / "notes.txt").write_text("the user's own\n")
    assert handover.copy_logs(work, dest) == dest
    assert sorted(p.name for p in dest.iterdir()) == ["broker-2-0-A.err", "broker-2-0-broker.log", "notes.txt"]
    assert (dest / "broker-2-0-broker.log").read_text() == "event=pressure kind=watermark\n"


def test_the_broker_log_level_is_one_the_broker_takes(handover, capsys):
    from kvcached_broker.broker.cli import build_parser
    from kvcached_broker.broker.config import LOG_LEVELS

    for level in LOG_LEVELS:  # what the benchmark offers (its choices are these)
        assert build_parser().parse_args(["serve", "--log-level", level]).log_level == level
    with pytest.raises(SystemExit) as exit_:
        handover.main(["--broker-log-level", "verbose", "--traces", "", "--trials", "0"])
    assert exit_.value.code == 2
    assert "invalid choice: 'verbose'" in capsys.readouterr().err
