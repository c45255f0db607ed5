"""The session table alone (``broker/sessions.py``): lookups, fences, the reply cache of a
binding and the hello rate limiter; examples, and a Hypothesis state machine for the table."""

from __future__ import annotations

import itertools
import os
import re
import secrets

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from kvcached_broker.broker import sessions as sessions_module
from kvcached_broker.broker.sessions import Binding, HelloRateLimiter, SessionTable
from kvcached_broker.client import protocol as proto
from kvcached_broker.client.errors import BadRequest

EXAMPLES = int(os.environ.get("SESSIONS_EXAMPLES", "100"))

_serial = itertools.count()


def binding(session_id=None, token=None, nonce=None, pid=100, pid_verified=True, uid=1000, **kw) -> Binding:
    n = next(_serial)
    return Binding(
        session_id=session_id or f"s-{n:08x}", token=token or f"token-{n:06d}-secret", nonce=nonce or f"nonce-{n:06d}",
        pid=pid, pid_verified=pid_verified, pid_start_ticks=None, uid=uid, version=1, **kw,
    )


# ----------------------------------------------------------------------------- the table
def test_add_and_remove_keep_every_lookup_consistent():
    table = SessionTable()
    a = binding(pid=10, uid=1000)
    b = binding(pid=10, uid=1000)
    c = binding(pid=11, uid=None)
    remote = binding(pid=10, pid_verified=False, uid=2000)  # its pid is only a claim
    for x in (a, b, c, remote):
        table.add(x)
    assert len(table) == 4 and set(table) == {a, b, c, remote}
    assert table.by_token(a.token) is a and table.by_id(b.session_id) is b and table.by_nonce(c.nonce) is c
    assert table.session_ids_of_pid(10) == sorted([a.session_id, b.session_id])
    assert table.count_for_pid(10) == 2 and table.count_for_pid(11) == 1 and table.count_for_pid(12) == 0
    assert sorted(table.pids()) == [10, 11]
    assert table.count_for_uid(1000) == 2 and table.count_for_uid(2000) == 1 and table.count_for_uid(3000) == 0

    assert table.remove(a.session_id) is a
    assert table.by_token(a.token) is None and table.by_id(a.session_id) is None and table.by_nonce(a.nonce) is None
    assert table.session_ids_of_pid(10) == [b.session_id] and table.count_for_uid(1000) == 1
    assert table.remove(a.session_id) is None  # twice: nothing, and nothing else changes
    assert len(table) == 3 and table.count_for_uid(1000) == 1
    table.remove(b.session_id)
    assert table.count_for_pid(10) == 0 and sorted(table.pids()) == [11] and table.count_for_uid(1000) == 0
    table.remove(remote.session_id)
    table.remove(c.session_id)
    assert len(table) == 0 and list(table) == [] and table.pids() == []


def test_iterating_the_table_may_remove_sessions():
    table = SessionTable()
    for _ in range(5):
        table.add(binding())
    for x in table:  # a copy: ending sessions while walking them is safe
        table.remove(x.session_id)
    assert len(table) == 0


def test_rekey_nonce_moves_the_lookup():
    table = SessionTable()
    a = binding()
    table.add(a)
    old = a.nonce
    table.rekey_nonce(a, "nonce-resumed-1")
    assert a.nonce == "nonce-resumed-1" and table.by_nonce("nonce-resumed-1") is a and table.by_nonce(old) is None
    table.remove(a.session_id)
    assert table.by_nonce("nonce-resumed-1") is None


def test_a_nonce_another_session_took_over_is_not_dropped_by_the_first():
    table = SessionTable()
    first = binding(nonce="nonce-shared")
    second = binding(nonce="nonce-shared")
    table.add(first)
    table.add(second)
    assert table.by_nonce("nonce-shared") is second
    table.remove(first.session_id)
    assert table.by_nonce("nonce-shared") is second  # still the second's
    third = binding(nonce="nonce-third")
    table.add(third)
    table.rekey_nonce(first, "nonce-other")  # a binding that no longer owns its old nonce's entry
    assert table.by_nonce("nonce-shared") is second
    table.rekey_nonce(third, "nonce-shared")
    assert table.by_nonce("nonce-shared") is third and table.by_nonce("nonce-third") is None


def test_new_session_ids_are_well_formed_and_unique():
    table = SessionTable()
    seen_ids = set()
    for i in range(300):
        session_id = table.new_session_id()
        assert re.fullmatch(r"s-[0-9a-f]{8}", session_id)
        msgspec.convert(session_id, proto.PublicId)
        assert session_id not in seen_ids
        seen_ids.add(session_id)
        table.add(binding(session_id=session_id, token=f"token-{i:06d}"))


def test_new_session_ids_never_reuse_an_id_in_use(monkeypatch):
    table = SessionTable()
    taken = binding(session_id="s-0000beef")
    table.add(taken)
    draws = iter(["0000beef", "0000beef", "0000cafe"])
    monkeypatch.setattr(sessions_module.secrets, "token_hex", lambda n: next(draws))
    assert table.new_session_id() == "s-0000cafe"


def test_fence_keeps_the_newest_tokens_up_to_its_limit():
    table = SessionTable(fence_limit=3)
    evicted = [binding() for _ in range(5)]
    for x in evicted:
        table.fence(x)
        assert len(table.fenced) <= 3
    assert list(table.fenced.items()) == [(x.token, x.session_id) for x in evicted[2:]]
    assert evicted[0].token not in table.fenced and table.fenced[evicted[4].token] == evicted[4].session_id


# ----------------------------------------------------------------------------- the reply cache
def test_a_retried_request_gets_its_cached_reply_only_for_the_same_body():
    b = binding()
    assert b.replay(7, hash(b"acquire 3")) is None  # a new id
    b.remember_reply(7, hash(b"acquire 3"), b"reply-7", limit=4)
    assert b.replay(7, hash(b"acquire 3")) == b"reply-7"
    with pytest.raises(BadRequest, match="different request") as info:
        b.replay(7, hash(b"acquire 5"))
    assert info.value.code == "bad_request" and info.value.details == {"id": 7}
    assert b.replay(8, hash(b"acquire 5")) is None  # other ids are unaffected


def test_a_reply_remembered_for_any_body_answers_every_retry():
    b = binding()
    b.remember_reply(3, None, b"settled", limit=4)  # a release the worker had already booked
    assert b.replay(3, hash(b"release 4")) == b"settled" and b.replay(3, hash(b"anything")) == b"settled"


def test_trimming_keeps_at_least_the_last_limit_and_refuses_older_ids():
    b = binding()
    limit = 4
    for request_id in range(1, 2 * limit + 1):
        b.remember_reply(request_id, request_id, b"r%d" % request_id, limit)
    assert list(b.replies) == list(range(1, 9)) and b.forgotten_id == -1  # up to 2 * limit: kept
    b.remember_reply(9, 9, b"r9", limit)
    assert list(b.replies) == [6, 7, 8, 9] and b.forgotten_id == 5  # trimmed in bulk, down to limit
    for old in (1, 5):
        with pytest.raises(BadRequest, match="older than this session's reply window") as info:
            b.replay(old, old)
        assert info.value.details == {"id": old, "forgotten_id": 5}
    assert b.replay(6, 6) == b"r6" and b.replay(10, 10) is None


@pytest.mark.parametrize("reply_bytes", [9 << 10, 1 << 10])
def test_the_reply_cache_holds_a_bounded_number_of_bytes_and_the_newest_replies(reply_bytes):
    """512 replies of 9 KiB (a reserve naming 64 pools) were kept: 4.6 MiB a session."""
    from kvcached_broker.broker.sessions import MAX_REPLY_CACHE_BYTES, MIN_REPLIES_KEPT

    b = binding()
    for request_id in range(1, 601):
        b.remember_reply(request_id, request_id, b"%06d" % request_id + b"x" * (reply_bytes - 6), 256)
        assert b.reply_bytes == sum(len(reply) for _, reply in b.replies.values())
        assert b.reply_bytes <= max(MAX_REPLY_CACHE_BYTES, MIN_REPLIES_KEPT * reply_bytes) + reply_bytes
        assert len(b.replies) >= min(request_id, MIN_REPLIES_KEPT)
    assert list(b.replies) == list(range(601 - len(b.replies), 601))  # the newest
    assert b.replay(600, 600).startswith(b"000600")
    with pytest.raises(BadRequest, match="older than this session's reply window"):
        b.replay(b.forgotten_id, b.forgotten_id)


def test_a_reply_remembered_again_under_its_id_is_counted_once():
    b = binding()
    b.remember_reply(1, 1, b"x" * 100, 256)
    b.remember_reply(1, None, b"y" * 10, 256)  # a settled id's reply replaces the first
    assert b.reply_bytes == 10


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None)
@given(limit=st.integers(min_value=1, max_value=3), ids=st.lists(st.integers(min_value=0, max_value=40), max_size=60))
def test_the_reply_window_over_any_sequence_of_ids(limit, ids):
    b = binding()
    order: list[int] = []  # distinct ids, first remembered first
    for request_id in ids:
        if request_id in b.replies:
            assert b.replay(request_id, request_id) == b"r%d" % request_id
            continue
        if request_id <= b.forgotten_id:
            with pytest.raises(BadRequest):
                b.replay(request_id, request_id)
            continue
        assert b.replay(request_id, request_id) is None
        b.remember_reply(request_id, request_id, b"r%d" % request_id, limit)
        order.append(request_id)
        assert min(len(order), limit) <= len(b.replies) <= 2 * limit
        assert list(b.replies) == order[len(order) - len(b.replies):]  # the newest are kept
        trimmed = order[: len(order) - len(b.replies)]
        assert b.forgotten_id == (max(trimmed) if trimmed else -1)


# ----------------------------------------------------------------------------- hello rate
def test_hellos_come_in_a_burst_then_at_the_rate():
    limiter = HelloRateLimiter(rate_per_s=2.0, burst=3)
    assert [limiter.allow("peer", 100.0) for _ in range(4)] == [True, True, True, False]
    assert not limiter.allow("peer", 100.25)  # half a token
    assert limiter.allow("peer", 100.5)  # refusals do not cost tokens: one whole token now
    assert not limiter.allow("peer", 100.5)
    assert limiter.allow("other", 100.5)  # every peer has its own bucket
    assert [limiter.allow("peer", 200.0) for _ in range(4)] == [True, True, True, False]  # full again, not more


def test_a_zero_rate_allows_only_the_burst():
    limiter = HelloRateLimiter(rate_per_s=0.0, burst=2)
    assert [limiter.allow(("uid", "addr"), t) for t in (0.0, 1.0, 1e6)] == [True, True, False]


def _limiter_with_4096_peers() -> HelloRateLimiter:
    """4096 peers at t=0: one that spent its burst of 2, the others with 1 token left."""
    limiter = HelloRateLimiter(rate_per_s=1.0, burst=2)
    assert limiter.allow("spent", 0.0) and limiter.allow("spent", 0.0) and not limiter.allow("spent", 0.0)
    for peer in range(4095):
        assert limiter.allow(peer, 0.0)
    assert len(limiter._buckets) == 4096  # at the bound: nothing forgotten yet
    return limiter


def test_past_4096_peers_buckets_that_are_not_full_are_kept():
    limiter = _limiter_with_4096_peers()
    assert limiter.allow("one more", 0.0)
    assert len(limiter._buckets) == 4097  # nobody is full at t=0: everyone kept
    assert not limiter.allow("spent", 0.0) and limiter.allow(17, 0.0) and not limiter.allow(17, 0.0)


def test_past_4096_peers_full_buckets_are_forgotten():
    limiter = _limiter_with_4096_peers()
    assert limiter.allow("late", 1.0)  # one token back for everyone: those with 1 left are full
    assert set(limiter._buckets) == {"spent", "late"}
    assert limiter.allow("spent", 1.0) and not limiter.allow("spent", 1.0)  # its debt was kept
    assert limiter.allow(17, 1.0) and limiter.allow(17, 1.0) and not limiter.allow(17, 1.0)  # a full burst


# ----------------------------------------------------------------------------- state machine
class TableMachine(RuleBasedStateMachine):
    """Sessions open, resume with new nonces, end and get evicted; every lookup agrees with a
    plain list of live bindings after every step."""

    live = Bundle("live")

    @initialize(fence_limit=st.integers(min_value=1, max_value=4))
    def start(self, fence_limit):
        self.table = SessionTable(fence_limit=fence_limit)
        self.bindings: list[Binding] = []
        self.gone: list[Binding] = []
        self.retired_nonces: set[str] = set()
        self.fence_order: list[tuple[str, str]] = []
        self.nonces = itertools.count()

    def _nonce(self) -> str:
        return f"nonce-{next(self.nonces):06d}"

    @rule(target=live, pid=st.integers(min_value=1, max_value=4), verified=st.booleans(),
          uid=st.none() | st.integers(min_value=0, max_value=2))
    def open(self, pid, verified, uid):
        session_id, token = self.table.new_session_id(), secrets.token_urlsafe(24)
        assert session_id not in {b.session_id for b in self.bindings + self.gone}
        assert token not in {b.token for b in self.bindings + self.gone}
        b = Binding(session_id=session_id, token=token, nonce=self._nonce(), pid=pid, pid_verified=verified,
                    pid_start_ticks=None, uid=uid, version=1)
        self.table.add(b)
        self.bindings.append(b)
        return b

    @rule(b=live)
    def resume(self, b):
        if b not in self.bindings:
            return
        self.retired_nonces.add(b.nonce)
        self.table.rekey_nonce(b, self._nonce())

    @rule(b=consumes(live), evict=st.booleans())
    def end(self, b, evict):
        if evict:
            self.table.fence(b)
            self.fence_order.append((b.token, b.session_id))
        assert self.table.remove(b.session_id) is b
        self.bindings.remove(b)
        self.gone.append(b)
        self.retired_nonces.add(b.nonce)

    @rule()
    def remove_unknown(self):
        assert self.table.remove("s-unknown") is None

    @invariant()
    def lookups_agree(self):
        table, live = self.table, self.bindings
        assert len(table) == len(live) and set(table) == set(live)
        for b in live:
            assert table.by_token(b.token) is b and table.by_id(b.session_id) is b and table.by_nonce(b.nonce) is b
        for b in self.gone:
            assert table.by_token(b.token) is None and table.by_id(b.session_id) is None
        for nonce in self.retired_nonces:
            assert table.by_nonce(nonce) is None
        verified = [b for b in live if b.pid_verified]
        assert sorted(table.pids()) == sorted({b.pid for b in verified})
        for pid in range(1, 5):
            ids = sorted(b.session_id for b in verified if b.pid == pid)
            assert table.session_ids_of_pid(pid) == ids and table.count_for_pid(pid) == len(ids)
        for uid in range(3):
            assert table.count_for_uid(uid) == sum(b.uid == uid for b in live)

    @invariant()
    def fence_is_bounded_and_keeps_the_newest(self):
        fenced = self.table.fenced
        assert len(fenced) <= self.table.fence_limit
        assert list(fenced.items()) == self.fence_order[-self.table.fence_limit:]


TestTableMachine = TableMachine.TestCase
TestTableMachine.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=30, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
