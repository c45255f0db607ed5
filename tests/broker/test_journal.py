"""The journal alone (broker/journal.py): group commit, deferral of decrease-only rounds, rounds
that end where the journal already is, snapshots and compaction, fences, and restore.

A request core supplies the ledger and the session table it journals (sessions are opened and
changed with requests, ``helpers.CoreSession``); the journal's methods are called as the shell
calls them, once per round, and the files are read as documented (``helpers.journal_records``).
"""

from __future__ import annotations

import logging

import msgspec

from kvcached_broker.broker.accounts import Limits
from kvcached_broker.broker.checkpoint import StateStore
from kvcached_broker.broker.journal import DEFER_S, NullJournal, limit_record, limits_of, replay
from kvcached_broker.broker.state_records import (
    CloseRecord,
    FenceRecord,
    HoldRecord,
    LimitRecord,
    SessionRecord,
    Snapshot,
    UnlimitRecord,
)

from helpers import GIB, CoreConnection, CoreSession, journal_records, make_core, restarted_core


def _journal(state_dir):
    return state_dir / "gpu0.journal"


def _kinds(state_dir) -> list[str]:
    return [r["kind"] for r in journal_records(_journal(state_dir))]


def _ledger_after_a_crash(core, state_dir, total_bytes: int = 8 * GIB):
    """The broker dies here, its files as they are, and a new one restarts from them: its ledger."""
    core.journal.store.close()
    return restarted_core(state_dir, total_bytes).ledger


def test_a_new_session_is_written_whole_and_its_changes_as_holdings(short_tmp):
    core = restarted_core(short_tmp, 8 * GIB)
    c = CoreSession(core, "w", page_bytes=GIB)
    assert _kinds(short_tmp) == []  # nothing until the round's commit
    core.journal.commit(0.0)
    (opened,) = journal_records(_journal(short_tmp))
    assert opened["kind"] == "session" and opened["id"] == c.session_id and opened["token"] == c.token
    c.acquire(3)
    c.result("reserve", pools={"weights": GIB})
    core.journal.commit(0.0)  # one round, two changes of one session: one record
    assert _kinds(short_tmp) == ["session", "hold"]
    hold = journal_records(_journal(short_tmp))[-1]
    assert hold["session_id"] == c.session_id and hold["granted_pages"] == 3 and hold["pools"] == {"weights": GIB}


def test_growth_is_on_disk_when_commit_returns(short_tmp):
    core = restarted_core(short_tmp, 8 * GIB)
    c = CoreSession(core, "w", page_bytes=GIB)
    core.journal.commit(0.0)
    c.acquire(2)
    core.journal.commit(5.0)
    assert journal_records(_journal(short_tmp))[-1]["granted_pages"] == 2
    assert not core.journal.flush_due(5.0)  # nothing left waiting


def test_a_decrease_waits_for_its_grace_even_past_another_sessions_durable_write(short_tmp):
    core = restarted_core(short_tmp, 8 * GIB)
    c = CoreSession(core, "w", page_bytes=GIB)
    c.acquire(4)
    core.journal.commit(10.0)
    written = journal_records(_journal(short_tmp))

    c.result("release", pages=1)
    core.journal.commit(10.0)  # only a decrease: deferred (a crash over-charges, which is safe)
    assert journal_records(_journal(short_tmp)) == written
    assert not core.journal.flush_due(10.0 + DEFER_S / 2)
    assert core.journal.flush_due(10.0 + DEFER_S)  # its grace is over: written
    assert journal_records(_journal(short_tmp))[-1]["granted_pages"] == 3

    c.result("release", pages=1)
    core.journal.commit(20.0)  # deferred again
    other = CoreSession(core, "v", page_bytes=GIB)
    core.journal.commit(20.0 + DEFER_S / 2)  # a new session is durable now; the decrease still waits
    records = journal_records(_journal(short_tmp))
    assert records[-1]["kind"] == "session" and records[-1]["id"] == other.session_id
    assert records[-2]["granted_pages"] == 3
    assert not core.journal.flush_due(20.0 + DEFER_S / 2)
    assert core.journal.flush_due(20.0 + DEFER_S)  # the grace of its first deferral
    assert journal_records(_journal(short_tmp))[-1]["granted_pages"] == 2
    assert not core.journal.flush_due(30.0)


def test_a_session_that_ends_the_round_where_its_record_is_writes_nothing(short_tmp):
    core = restarted_core(short_tmp, 8 * GIB)
    c = CoreSession(core, "w", page_bytes=GIB)
    c.acquire(4)
    core.journal.commit(0.0)
    before = journal_records(_journal(short_tmp))
    c.acquire(1)
    c.result("release", pages=1)  # a page out and back in one round
    core.journal.commit(0.0)
    assert journal_records(_journal(short_tmp)) == before
    assert not core.journal.flush_due(1.0)
    c.acquire(1)
    core.journal.commit(0.0)  # a real change after it is written as usual
    assert journal_records(_journal(short_tmp))[-1]["granted_pages"] == 5


def test_a_deferred_decrease_taken_back_before_its_grace_is_never_written(short_tmp):
    core = restarted_core(short_tmp, 8 * GIB)
    c = CoreSession(core, "w", page_bytes=GIB)
    c.acquire(4)
    core.journal.commit(0.0)
    written = journal_records(_journal(short_tmp))
    for round_s in (1.0, 1.001, 1.002):  # a page out and back in separate rounds, as in a ping-pong
        c.result("release", pages=1)
        core.journal.commit(round_s)
        c.acquire(1)
        core.journal.commit(round_s)  # a growth round, yet back at the written record: no write
    assert journal_records(_journal(short_tmp)) == written
    assert not core.journal.flush_due(2.0)  # and nothing is left waiting
    # a crash here: the disk says what the session holds
    assert _ledger_after_a_crash(core, short_tmp).sessions[c.session_id].granted_pages == 4


def test_a_waiting_decrease_is_replaced_by_newer_ones_and_only_growth_past_the_written_record_is_written(short_tmp):
    core = restarted_core(short_tmp, 8 * GIB)
    c, other = CoreSession(core, "w", page_bytes=GIB), CoreSession(core, "v", page_bytes=GIB)
    c.acquire(4)
    other.acquire(2)
    core.journal.commit(0.0)
    written = journal_records(_journal(short_tmp))
    c.result("release", pages=1)
    core.journal.commit(1.0)
    c.result("release", pages=1)
    other.result("release", pages=1)
    core.journal.commit(1.001)  # two decreases of c, one of other: all wait
    c.acquire(1)  # c back up to 3: still below its written 4, so it waits (replacing its 2)
    core.journal.commit(1.002)
    assert journal_records(_journal(short_tmp)) == written
    c.acquire(2)  # c at 5: past its written 4, so written now; other's decrease still waits
    core.journal.commit(1.003)
    new = journal_records(_journal(short_tmp))[len(written):]
    assert [(r["session_id"], r["granted_pages"]) for r in new] == [(c.session_id, 5)]
    assert core.journal.flush_due(2.0)
    new = journal_records(_journal(short_tmp))[len(written):]
    assert [(r["session_id"], r["granted_pages"]) for r in new] == [(c.session_id, 5), (other.session_id, 1)]
    assert not core.journal.flush_due(3.0)
    restored = _ledger_after_a_crash(core, short_tmp).sessions
    assert restored[c.session_id].granted_pages == 5 and restored[other.session_id].granted_pages == 1


def test_a_round_that_grows_and_shrinks_a_session_below_its_record_is_not_urgent(short_tmp):
    core = restarted_core(short_tmp, 8 * GIB)
    c = CoreSession(core, "w", page_bytes=GIB)
    c.acquire(3)
    core.journal.commit(0.0)
    written = journal_records(_journal(short_tmp))
    c.acquire(1)
    c.result("release", pages=2)  # up to 4, then down to 2 in one round: answered at 2
    core.journal.commit(1.0)
    assert journal_records(_journal(short_tmp)) == written  # the disk's 3 over-charges: safe
    assert core.journal.flush_due(1.0 + DEFER_S)
    assert journal_records(_journal(short_tmp))[-1]["granted_pages"] == 2


def test_a_hold_past_the_written_one_is_urgent_even_when_pages_pay_for_it(short_tmp):
    core = restarted_core(short_tmp, 8 * GIB)
    c = CoreSession(core, "w", page_bytes=GIB)
    c.acquire(2)
    core.journal.commit(0.0)
    c.result("release", pages=1)
    c.result("reserve", pools={}, holds={"swa": GIB})  # same bytes in all, but a hold is charged in full
    core.journal.commit(1.0)
    last = journal_records(_journal(short_tmp))[-1]
    assert last["granted_pages"] == 1 and last["holds"] == {"swa": GIB}


def test_sessions_that_churn_pages_write_once_per_grace_not_once_per_round(short_tmp):
    """Four sessions each take a page and give it back across rounds, out of step: a growth
    of one must not write the others' waiting decreases, or each of them, grown back, would
    be written again (a chain of writes in nearly every round)."""
    core = restarted_core(short_tmp, 64 * GIB)
    sessions = [CoreSession(core, f"w{i}", page_bytes=GIB) for i in range(4)]
    for s in sessions:
        s.acquire(4)
    core.journal.commit(0.0)
    written = len(journal_records(_journal(short_tmp)))
    now_s = 1.0
    for round_index in range(40):  # 40 rounds inside one grace
        for i, s in enumerate(sessions):
            if (round_index + i) % 2:
                s.result("release", pages=1)
            else:
                s.acquire(1)
        now_s += DEFER_S / 100
        core.journal.commit(now_s)
    churn = journal_records(_journal(short_tmp))[written:]
    assert len(churn) <= 4  # each session's first growth above its record, once
    core.journal.flush()
    restored = _ledger_after_a_crash(core, short_tmp, 64 * GIB).sessions  # flushed: what each holds
    assert all(restored[s.session_id].granted_pages == core.ledger.sessions[s.session_id].granted_pages
               for s in sessions)


def test_a_decrease_whose_room_another_session_took_is_written_with_that_growth(short_tmp):
    """Left waiting, the decrease and the growth into the room it freed would both be on disk:
    a restart would charge that room twice (overbooked with no outside usage)."""
    core = restarted_core(short_tmp, 8 * GIB)
    a, b = CoreSession(core, "a", page_bytes=GIB), CoreSession(core, "b", page_bytes=GIB)
    full_pages = core.ledger.budget_bytes // GIB
    assert a.acquire(full_pages) == full_pages
    core.journal.commit(0.0)
    a.result("release", pages=2)
    core.journal.commit(1.0)  # waits: nobody needs its room yet
    assert b.acquire(2) == 2  # the room a freed
    core.journal.commit(1.001)
    last_two = journal_records(_journal(short_tmp))[-2:]
    assert [(r["session_id"], r["granted_pages"]) for r in last_two] == [(a.session_id, full_pages - 2),
                                                                         (b.session_id, 2)]
    restored = _ledger_after_a_crash(core, short_tmp)
    assert restored.charged_bytes <= restored.budget_bytes and not restored.overcommitted


def test_a_decrease_whose_room_under_its_instance_cap_a_sibling_took_is_written_with_it(short_tmp):
    core = restarted_core(short_tmp, 8 * GIB, is_admin=lambda peer: True)
    assert CoreConnection(core).ask({"op": "limit", "id": 1, "instance": "w", "max_bytes": 4 * GIB})["ok"]
    a, b = CoreSession(core, "w", page_bytes=GIB), CoreSession(core, "w", page_bytes=GIB)
    assert a.acquire(4) == 4
    core.journal.commit(0.0)
    a.result("release", pages=1)
    core.journal.commit(1.0)  # waits
    assert b.acquire(1) == 1  # the room under the cap a freed
    core.journal.commit(1.001)
    assert not core.journal.flush_due(1.001 + DEFER_S)  # a's decrease went with b's growth
    restored = _ledger_after_a_crash(core, short_tmp)
    assert restored.instance_charge_bytes("w") <= 4 * GIB


def test_a_closed_session_s_waiting_decrease_is_never_written_after_its_close(short_tmp):
    core = restarted_core(short_tmp, 8 * GIB)
    c = CoreSession(core, "w", page_bytes=GIB)
    c.acquire(2)
    core.journal.commit(0.0)
    c.result("release", pages=1)
    core.journal.commit(1.0)  # waits
    c.result("close")
    core.journal.commit(1.001)
    assert not core.journal.flush_due(2.0)  # nothing of it waits any more
    assert [r["kind"] for r in journal_records(_journal(short_tmp))] == ["session", "close"]
    assert c.session_id not in _ledger_after_a_crash(core, short_tmp).sessions


def test_a_snapshot_drops_waiting_decreases_it_already_holds(short_tmp):
    core = restarted_core(short_tmp, 8 * GIB)
    store: StateStore = core.journal.store
    c, other = CoreSession(core, "w", page_bytes=GIB), CoreSession(core, "v", page_bytes=GIB)
    c.acquire(3)
    core.journal.commit(0.0)
    c.result("release", pages=1)
    core.journal.commit(1.0)  # c's decrease waits
    store.compact_after_bytes = store.journal_bytes + 1  # the next write passes it
    other.acquire(1)
    core.journal.commit(1.001)  # other's growth is written, then compacted into a snapshot
    assert _journal(short_tmp).stat().st_size == 0
    assert not core.journal.flush_due(2.0)  # c's decrease is in the snapshot; nothing waits
    restored = _ledger_after_a_crash(core, short_tmp).sessions
    assert restored[c.session_id].granted_pages == 2 and restored[other.session_id].granted_pages == 1


def test_a_resumed_session_with_a_deferred_decrease_is_written_whole(short_tmp):
    core = restarted_core(short_tmp, 8 * GIB)
    c = CoreSession(core, "w", page_bytes=GIB)
    c.acquire(2)
    core.journal.commit(0.0)
    c.result("release", pages=1)
    core.journal.commit(1.0)  # deferred
    again = CoreConnection(core).hello("nonce-resumed-2", instance="w", page_bytes=GIB, resume=c.token)
    assert again["ok"]
    core.journal.commit(1.001)  # a new nonce: the whole record, with what it holds now
    last = journal_records(_journal(short_tmp))[-1]
    assert last["kind"] == "session" and last["nonce"] == "nonce-resumed-2" and last["granted_pages"] == 1


def test_a_grace_that_ends_between_a_resume_and_its_commit_leaves_the_whole_record_to_the_commit(short_tmp):
    """The server runs its timers (the grace's flush) after a round's requests and before its
    commit: a resume in that round has dropped what the journal knew of the session's record."""
    core = restarted_core(short_tmp, 8 * GIB)
    c = CoreSession(core, "w", page_bytes=GIB)
    c.acquire(2)
    core.journal.commit(0.0)
    c.result("release", pages=1)
    core.journal.commit(1.0)  # waits
    assert CoreConnection(core).hello("nonce-resumed-3", instance="w", page_bytes=GIB, resume=c.token)["ok"]
    core.journal.flush_due(1.0 + DEFER_S)
    core.journal.commit(1.0 + DEFER_S)
    assert _kinds(short_tmp) == ["session", "session"]  # no record of the old identity in between
    last = journal_records(_journal(short_tmp))[-1]
    assert last["nonce"] == "nonce-resumed-3" and last["granted_pages"] == 1
    assert not core.journal.flush_due(2.0)


def test_closes_limits_and_fences_are_written_at_once(short_tmp):
    core = restarted_core(short_tmp, 8 * GIB, is_admin=lambda peer: True)
    a, b = CoreSession(core, "a", page_bytes=GIB), CoreSession(core, "b", page_bytes=GIB)
    core.journal.commit(0.0)
    admin = CoreConnection(core)
    assert admin.ask({"op": "limit", "id": 1, "instance": "a", "max_bytes": 2 * GIB})["ok"]
    core.journal.commit(0.0)
    limit = journal_records(_journal(short_tmp))[-1]
    assert limit["kind"] == "limit" and limit["instance"] == "a" and limit["max_bytes"] == 2 * GIB
    a.result("close")
    core.journal.commit(0.0)  # a close only frees memory, but it is written at once
    close = journal_records(_journal(short_tmp))[-1]
    assert close["kind"] == "close" and close["session_id"] == a.session_id
    assert admin.ask({"op": "evict", "id": 2, "session_id": b.session_id})["ok"]
    core.journal.commit(0.0)
    fence, close = journal_records(_journal(short_tmp))[-2:]
    assert fence["kind"] == "fence" and fence["token"] == b.token and fence["session_id"] == b.session_id
    assert close["kind"] == "close" and close["session_id"] == b.session_id


def test_a_fence_alone_is_a_round_to_write(short_tmp):
    core = restarted_core(short_tmp, 8 * GIB)
    core.journal.fence("token-fenced-00001", "s-00000009")
    core.journal.commit(0.0)  # no ledger change, but the fence must not wait
    (record,) = journal_records(_journal(short_tmp))
    assert record["kind"] == "fence" and record["token"] == "token-fenced-00001"


def test_a_resume_writes_the_whole_record_again(short_tmp):
    core = restarted_core(short_tmp, 8 * GIB)
    c = CoreSession(core, "w", page_bytes=GIB)
    c.acquire(1)
    core.journal.commit(0.0)
    assert _kinds(short_tmp) == ["session"]
    again = CoreConnection(core).hello("nonce-resumed-1", instance="w", page_bytes=GIB, resume=c.token)
    assert again["ok"] and again["result"]["resumed"]
    core.journal.commit(0.0)  # its nonce changed: not a holdings record, the whole one
    last = journal_records(_journal(short_tmp))[-1]
    assert _kinds(short_tmp) == ["session", "session"]
    assert last["id"] == c.session_id and last["nonce"] == "nonce-resumed-1" and last["granted_pages"] == 1


def test_past_its_size_limit_the_journal_is_compacted_into_a_snapshot(short_tmp):
    core = restarted_core(short_tmp, 8 * GIB)
    store: StateStore = core.journal.store
    c = CoreSession(core, "w", page_bytes=GIB)
    core.journal.commit(0.0)
    store.compact_after_bytes = store.journal_bytes + 1  # the next write passes it
    c.acquire(2)
    core.journal.commit(0.0)
    assert _journal(short_tmp).stat().st_size == 0 and store.journal_bytes == 0
    c.acquire(1)
    core.journal.commit(0.0)  # the snapshot holds the whole record: holdings follow it
    (record,) = journal_records(_journal(short_tmp))
    assert record["kind"] == "hold" and record["granted_pages"] == 3
    core.journal.close()
    restored = restarted_core(short_tmp, 8 * GIB)
    assert restored.ledger.sessions[c.session_id].granted_pages == 3


def test_a_clean_close_leaves_one_snapshot_and_an_empty_journal(short_tmp):
    core = restarted_core(short_tmp, 8 * GIB)
    c = CoreSession(core, "w", page_bytes=GIB)
    c.acquire(2)
    core.journal.commit(0.0)
    c.result("release", pages=1)
    core.journal.commit(0.0)  # deferred: the close writes it
    core.journal.close()
    assert _journal(short_tmp).read_bytes() == b""
    loaded = StateStore(short_tmp, 0).open()
    (session,) = loaded.snapshot.sessions
    assert session.id == c.session_id and session.granted_pages == 1 and loaded.records == []


def test_restore_brings_back_sessions_limits_and_fences(short_tmp):
    core = restarted_core(short_tmp, 8 * GIB, is_admin=lambda peer: True)
    kept, evicted = CoreSession(core, "kept", page_bytes=GIB), CoreSession(core, "gone", page_bytes=GIB)
    kept.result("reserve", pools={"weights": GIB})
    kept.acquire(2)
    admin = CoreConnection(core)
    assert admin.ask({"op": "limit", "id": 1, "instance": "kept", "max_bytes": 4 * GIB, "weight": 2.0,
                      "priority": -3})["ok"]
    assert admin.ask({"op": "evict", "id": 2, "session_id": evicted.session_id})["ok"]
    core.journal.commit(0.0)  # no close: the next core reads the journal, not a snapshot

    fresh = make_core(8 * GIB, state_dir=short_tmp)
    restored = fresh.journal.restore()
    assert restored.found_state and restored.damage is None
    (record,) = restored.sessions
    assert record.id == kept.session_id and record.granted_pages == 2 and record.pools == {"weights": GIB}
    assert fresh.ledger.limits["kept"].max_bytes == 4 * GIB and fresh.ledger.limits["kept"].weight == 2.0
    assert fresh.ledger.limits["kept"].priority == -3
    assert fresh.table.fenced == {evicted.token: evicted.session_id}
    assert not fresh.ledger.sessions  # sessions come back only through the core (their processes checked)
    fresh.restore(restored, 1.0)
    fresh.journal.started()  # what it rebuilt is the new snapshot
    assert fresh.ledger.sessions[kept.session_id].state.value == "recovering"
    assert _journal(short_tmp).read_bytes() == b""


def test_state_for_another_device_is_ignored(short_tmp, caplog):
    store = StateStore(short_tmp, 0)
    store.open()
    store.write_snapshot(Snapshot(device_uuid="GPU-someone-else", limits=[LimitRecord(instance="x", max_bytes=GIB)]))
    store.close()
    core = make_core(8 * GIB, state_dir=short_tmp)
    with caplog.at_level(logging.WARNING, logger="kvcached_broker"):
        restored = core.journal.restore()
    assert restored.sessions == [] and not core.ledger.limits and not restored.found_state
    assert "event=state_device_mismatch" in caplog.text


def test_damage_found_by_the_load_is_reported(short_tmp):
    core = restarted_core(short_tmp, 8 * GIB)
    c = CoreSession(core, "w", page_bytes=GIB)
    core.journal.commit(0.0)
    c.acquire(2)
    core.journal.commit(0.0)
    data = bytearray(_journal(short_tmp).read_bytes())
    data[-1] ^= 0x01  # the last record's payload
    _journal(short_tmp).write_bytes(bytes(data))
    restored = make_core(8 * GIB, state_dir=short_tmp).journal.restore()
    assert restored.damage == {"damaged_records": 1, "damaged_bytes": restored.damage["damaged_bytes"],
                               "torn_bytes": 0, "snapshot": None, "missing": [], "lost_records": 0,
                               "records_lost": True}
    (record,) = restored.sessions
    assert record.granted_pages == 0  # the whole record survived, its later holdings did not


def test_replay_applies_records_in_order_over_the_snapshot():
    base = SessionRecord(id="s-00000001", token="token-0001-abcdefgh", nonce="nonce-0001-xyz", instance="a",
                         pid=100, pid_verified=True, page_bytes=GIB, granted_pages=1)
    other = SessionRecord(id="s-00000002", token="token-0002-abcdefgh", nonce="nonce-0002-xyz", instance="b",
                          pid=101, pid_verified=True, page_bytes=GIB)
    snap = Snapshot(device_uuid="SIM-GPU-0", sessions=[base, other], limits=[LimitRecord(instance="a", max_bytes=GIB)])
    records = [
        HoldRecord(session_id="s-00000001", granted_pages=5, pools={"w": 1}),
        HoldRecord(session_id="s-00000009", granted_pages=7),  # a session it never saw: ignored
        CloseRecord(session_id="s-00000002"),
        UnlimitRecord(instance="a"),
        LimitRecord(instance="b", min_bytes=GIB),
        FenceRecord(token="token-0002-abcdefgh", session_id="s-00000002"),
    ]
    sessions, limits, fenced = replay(snap, records)
    assert list(sessions) == ["s-00000001"] and sessions["s-00000001"].granted_pages == 5
    assert sessions["s-00000001"].pools == {"w": 1} and sessions["s-00000001"].token == base.token
    assert list(limits) == ["b"] and fenced == {"token-0002-abcdefgh": "s-00000002"}
    assert replay(None, records[:1]) == ({}, {}, {})


def test_the_null_journal_forgets(short_tmp):
    core = make_core(8 * GIB)
    assert isinstance(core.journal, NullJournal)
    c = CoreSession(core, "w", page_bytes=GIB)
    c.acquire(1)
    core.journal.commit(0.0)
    assert core.ledger.drain_changes() is None  # drained, as a round's commit does
    assert core.journal.restore().sessions == [] and not core.journal.flush_due(100.0)
    assert list(short_tmp.iterdir()) == []


def test_an_instances_limits_go_through_the_journal_whole():
    """Every field of the broker's limits is in its journal record, and comes back as it was."""
    limits = Limits(max_bytes=8 * GIB, min_bytes=GIB, weight=2.5, revision=7, source="hello", priority=-3,
                    owner_uid=1234)
    record = limit_record("model-a", limits)
    assert record.instance == "model-a"
    assert limits_of(msgspec.msgpack.decode(msgspec.msgpack.encode(record), type=LimitRecord)) == limits
