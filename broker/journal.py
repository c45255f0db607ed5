"""The journal: what the ledger and the session table must not forget, on disk (no I/O elsewhere).

``Journal`` owns the state store (``checkpoint``) and the rule that keeps a restarted broker
from handing memory out twice: a session that ends a round charged more than its last
*written* record says is written before the round is answered (group commit:
:meth:`Journal.commit` once per round, before the replies go out).  It also owns

* **deferral**: a session that ends a round charged no more than its written record (it
  released pages, or took some back short of what the disk says) waits up to ``DEFER_S``;
  losing that record in a crash over-charges until the worker re-asserts what it holds, which
  is safe.  A write of other sessions takes waiting records along only when what is on disk
  would otherwise no longer fit the budget or a cap (a growth took the room a waiting
  decrease freed: a restart would charge it twice).  Otherwise they keep waiting: a session
  that grew back to what it held would need writing again, so under page churn each session
  is written about once per grace rather than in nearly every round;
* **no-op rounds**: a session that ends a round where its latest record left it (a page out
  and back) is not written at all, and a session that returns to its written record while a
  record of it waits drops that record unwritten (what is on disk is right again);
* **snapshots** (when the journal passes its size limit, and at a clean stop);
* **replay** at start-up (:meth:`Journal.restore`), with the damage it found;
* **failed writes** (a full disk): the broker goes on serving from memory.  The first failure
  marks the snapshot stale on disk (so a restart holds growth until the workers re-assert),
  logs one error line and shows in status (:class:`StateWrites`); nothing more is appended, and
  :meth:`Journal.retry_failed_write` tries the whole state as a snapshot until one is written.

``NullJournal`` is the same interface for ``--no-state``: it forgets.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, NamedTuple

import msgspec

from ..client import protocol as proto
from .checkpoint import LoadedState, StateStore
from .accounts import Limits, Session, SessionState
from .ledger import Ledger
from .sessions import Binding, SessionTable
from .state_records import (
    CloseRecord,
    FenceRecord,
    HoldRecord,
    JournalRecord,
    LimitRecord,
    SessionRecord,
    Snapshot,
    UnlimitRecord,
)

log = logging.getLogger("kvcached_broker")

#: How long decrease-only journal records may wait for the next durable write.
DEFER_S = 0.02
#: While state writes fail: how often the server retries a snapshot, and every how many
#: retries that fail again one is logged (about once a minute).
RETRY_WRITE_S = 1.0
LOG_EVERY_RETRIES = 60


class StateWrites:
    """Whether the state directory takes writes.  ``error`` is set from the first failed write
    until a snapshot is written again; meanwhile the state lives in memory only."""

    def __init__(self) -> None:
        self.error: str | None = None
        self.failures = 0  # writes that failed, retries included
        self.recoveries = 0  # times a retry wrote the state again
        self.marked_stale = False  # the snapshot on disk was marked stale by the last failure

    def to_dict(self) -> dict[str, Any]:
        return {"failing": self.error is not None, "error": self.error, "failures": self.failures,
                "recoveries": self.recoveries, "snapshot_marked_stale": self.marked_stale,
                "retry_every_s": RETRY_WRITE_S}


class Holdings(NamedTuple):
    """What a session's journal ``hold`` record carries, copied out of the ledger."""

    granted_pages: int
    reserve_pages: int
    pools: dict[str, int]
    usage: dict[str, int]
    holds: dict[str, int]
    unmapped_pages: int
    phase: str

    @classmethod
    def of(cls, session: Session) -> "Holdings":
        return cls(session.granted_pages, session.reserve_pages, dict(session.pools), dict(session.usage),
                   dict(session.holds), session.unmapped_pages, session.phase)

    def still(self, session: Session) -> bool:
        """Whether ``session`` holds exactly this (compared in place, without copying)."""
        return self == (session.granted_pages, session.reserve_pages, session.pools, session.usage, session.holds,
                        session.unmapped_pages, session.phase)

    def reported_bytes(self, page_bytes: int) -> int:
        """What these holdings charge in all: pools, holds and pages."""
        return _charged_bytes(self.pools, self.holds, self.granted_pages, page_bytes)

    def charged_below(self, session: Session) -> bool:
        """Whether ``session`` is charged more than these holdings say: in all, or in what is
        charged in full (holds and unmapped pages).  Only then must a record of it be on disk
        before it is answered; a disk that says more over-charges, which is safe on its own."""
        return (session.reported_bytes > self.reported_bytes(session.page_bytes)
                or session.promised_bytes > sum(self.holds.values()) + self.unmapped_pages * session.page_bytes)

    def record(self, session_id: str) -> HoldRecord:
        return HoldRecord(session_id=session_id, pools=self.pools, granted_pages=self.granted_pages,
                          reserve_pages=self.reserve_pages, usage=self.usage, holds=self.holds,
                          unmapped_pages=self.unmapped_pages, phase=self.phase)


@dataclass
class Restored:
    """What a journal replay found: the state, and any damage it had to skip."""

    sessions: list[SessionRecord] = field(default_factory=list)
    damage: dict[str, Any] | None = None  # None: the state was read whole
    found_state: bool = False
    secret: bytes | None = None  # the key of the session tokens, kept in the state directory


class NullJournal:
    """``--no-state``: nothing is kept, so a restarted broker starts empty."""

    def __init__(self, ledger: Ledger, table: SessionTable):
        self._ledger = ledger

    def restore(self) -> Restored:
        return Restored()

    def commit(self, now_s: float) -> None:
        self._ledger.drain_changes()

    def fence(self, token: str, session_id: str) -> None:
        return None

    def rewrite(self, session_id: str) -> None:
        return None

    def flush_due(self, now_s: float) -> bool:
        return False

    def retry_failed_write(self, now_s: float) -> bool:
        return False

    def write_status(self) -> dict[str, Any] | None:
        return None

    def started(self) -> None:
        self._ledger.drain_changes()

    def close(self) -> None:
        return None


class Journal:
    def __init__(self, store: StateStore, ledger: Ledger, table: SessionTable):
        self.store = store
        self._ledger = ledger
        self._table = table
        self._pending: list[JournalRecord] = []  # written with the next commit (fences)
        # Sessions whose full record is on disk, each with the holdings its latest record
        # carries, written or waiting (None: not known here, so the next change is written in
        # full).
        self._on_disk: dict[str, Holdings | None] = {}
        # Sessions whose latest record waits (what ``_on_disk`` says, not yet written), each
        # with the holdings its latest *written* record carries.
        self._waiting: dict[str, Holdings] = {}
        self._defer_until_s = 0.0
        self.writes = StateWrites()

    # ------------------------------------------------------------- writing
    def fence(self, token: str, session_id: str) -> None:
        """An evicted session's token: refused from then on, across restarts too."""
        self._pending.append(FenceRecord(token=token, session_id=session_id))

    def rewrite(self, session_id: str) -> None:
        """Write this session's whole record with its next change (its identity changed)."""
        self._on_disk.pop(session_id, None)

    def commit(self, now_s: float) -> None:
        """Write what the ledger changed this round; call before the round's replies go out.

        What must be durable now (a session charged more than its last written record says, a
        new session, closes, limits, fences) is written with one ``write()``.  A session now
        charged no more than its written record waits; so do other sessions' records already
        waiting, unless the disk without them would not fit (:meth:`_waiting_fits`).
        """
        changes = self._ledger.drain_changes()
        if changes is None and not self._pending:
            return
        records, self._pending = self._pending, []  # fences
        if changes is not None:
            waiting_before = len(self._waiting)
            self._session_records(changes.sessions, records)
            if self._waiting and not waiting_before:
                self._defer_until_s = now_s + DEFER_S
            for session_id in changes.closed:
                self._forget(session_id)
                records.append(CloseRecord(session_id=session_id))
            for instance in changes.limits:
                limits = self._ledger.limits.get(instance)
                records.append(limit_record(instance, limits) if limits else UnlimitRecord(instance=instance))
        if records:
            if self._waiting and not self._waiting_fits():
                records = [*self._take_waiting(), *records]
            self._write(records)

    def _waiting_fits(self) -> bool:
        """Whether what is on disk, with the records that wait left out, still fits the budget
        and every cap.  A waiting decrease may have freed the room that a growth written now
        took; a restart that read both would charge that room twice, so then they go along."""
        ledger = self._ledger
        extra_bytes = 0
        extra_by_instance: dict[str, int] = {}
        for session_id, written in self._waiting.items():
            session = ledger.sessions[session_id]
            extra = written.reported_bytes(session.page_bytes) - session.reported_bytes
            extra_bytes += extra
            extra_by_instance[session.instance] = extra_by_instance.get(session.instance, 0) + extra
        if ledger.charged_bytes + extra_bytes > ledger.budget_bytes:
            return False
        for instance, extra in extra_by_instance.items():
            limits = ledger.limits.get(instance)
            if limits is not None and limits.max_bytes is not None:
                if ledger.instance_charge_bytes(instance) + extra > limits.max_bytes:
                    return False
        return True

    def _take_waiting(self) -> list[JournalRecord]:
        """The records that wait, to be written now.  A session rewritten this round has none
        to give: its whole record comes with the change that follows (leaving its decrease
        unwritten meanwhile only over-charges)."""
        on_disk = self._on_disk
        records: list[JournalRecord] = []
        for session_id in self._waiting:
            holdings = on_disk.get(session_id)
            if holdings is not None:
                records.append(holdings.record(session_id))
        self._waiting.clear()
        return records

    def _session_records(self, session_ids: set[str], records: list[JournalRecord]) -> None:
        """Append a record per changed session that must be durable now; defer the others'."""
        on_disk = self._on_disk
        waiting = self._waiting
        sessions = self._ledger.sessions
        for session_id in session_ids:
            session = sessions[session_id]
            last = on_disk.get(session_id)
            if last is not None and last.still(session):
                continue  # back to what the journal already says (say, one page out and back)
            if session_id not in on_disk:  # new, or its identity changed: the whole record, now
                records.append(self._session_record(session_id))
                waiting.pop(session_id, None)
                on_disk[session_id] = Holdings.of(session)
                continue
            written = waiting.get(session_id)
            if written is not None and written.still(session):
                del waiting[session_id]  # back to what is written: the record that waits is moot
                on_disk[session_id] = written
                continue
            if written is None:
                written = last  # nothing waits: what is on disk is written
            holdings = on_disk[session_id] = Holdings.of(session)
            if written is None or written.charged_below(session):
                records.append(holdings.record(session_id))
                waiting.pop(session_id, None)
            else:  # charged no more than its written record: it waits, replacing any that waits
                waiting[session_id] = written

    def _forget(self, session_id: str) -> None:
        """The session closed: a record of it that waits is moot."""
        self._on_disk.pop(session_id, None)
        self._waiting.pop(session_id, None)

    def flush_due(self, now_s: float) -> bool:
        """Write the records that wait once their grace has passed; True if it wrote."""
        if self._waiting and now_s >= self._defer_until_s:
            self.flush()
            return True
        return False

    def flush(self) -> None:
        """Write every record that waits."""
        self._write(self._take_waiting())

    def _write(self, records: list[JournalRecord]) -> None:
        if not records or self.writes.error is not None:
            return  # while writes fail, only a whole snapshot (the retry) is written
        try:
            self.store.append(records)
        except OSError as exc:
            self._write_failed(exc)
            return
        if self.store.needs_compaction():
            self.write_snapshot()

    def write_snapshot(self) -> None:
        """The whole state as it is now: records that wait are older, so they are dropped."""
        if self.writes.error is not None:
            return
        try:
            self.store.write_snapshot(self._snapshot())
        except OSError as exc:
            self._write_failed(exc)
            return
        self._snapshot_written()

    def _snapshot_written(self) -> None:
        self._on_disk = dict.fromkeys(self._ledger.sessions)
        self._waiting.clear()

    def _write_failed(self, exc: OSError) -> None:
        """The first failed write: serve on from memory, and make the state on disk distrusted."""
        writes = self.writes
        writes.failures += 1
        writes.error = exc.strerror or str(exc)
        writes.marked_stale = self.store.mark_stale()
        log.error(
            "event=state_write_failed error=%r state_dir=%s snapshot_marked_stale=%s "
            "detail=serving_from_memory_a_crash_now_loses_what_changed_since_retrying_every_%gs",
            writes.error, self.store.state_dir, writes.marked_stale, RETRY_WRITE_S,
        )

    def retry_failed_write(self, now_s: float) -> bool:
        """While writes fail: try the whole state as a snapshot; True once it is written."""
        writes = self.writes
        if writes.error is None:
            return False
        try:
            self.store.write_snapshot(self._snapshot())
        except OSError as exc:
            writes.failures += 1
            writes.error = exc.strerror or str(exc)
            if writes.failures % LOG_EVERY_RETRIES == 0:
                log.error("event=state_write_failing error=%r failures=%d detail=still_serving_from_memory",
                          writes.error, writes.failures)
            return False
        self._snapshot_written()
        writes.error = None
        writes.marked_stale = False
        writes.recoveries += 1
        log.warning("event=state_write_recovered failures=%d detail=the_whole_state_is_on_disk_again", writes.failures)
        return True

    def write_status(self) -> dict[str, Any]:
        return self.writes.to_dict()

    def started(self) -> None:
        """After a restore: what it rebuilt is the new snapshot, and the journal starts empty."""
        self._ledger.drain_changes()
        self.write_snapshot()

    def close(self) -> None:
        """A clean stop: everything written, one snapshot, the journal empty."""
        try:
            self.commit(0.0)
            self.flush()
            if self.writes.error is not None:
                self.retry_failed_write(0.0)
            else:
                self.write_snapshot()
            if self.writes.error is not None:
                log.error("event=snapshot_failed error=%r detail=the_state_on_disk_is_older_than_this_broker_and_marked_stale",
                          self.writes.error)
        except Exception as exc:  # noqa: BLE001 - keep the journal; it is enough to recover
            log.error("event=snapshot_failed error=%s", exc)
        self.store.close()

    def _session_record(self, session_id: str) -> SessionRecord:
        s = self._ledger.sessions[session_id]
        b = self._table.by_id(session_id)
        assert b is not None
        return SessionRecord(
            id=s.id, token=b.token, nonce=b.nonce, instance=s.instance, pid=s.pid, pid_verified=s.pid_verified,
            pid_start_ticks=b.pid_start_ticks, uid=b.uid, rank=s.tp_rank, tp_size=s.tp_size,
            page_bytes=s.page_bytes, pools=dict(s.pools), granted_pages=s.granted_pages,
            reserve_pages=s.reserve_pages, usage=dict(s.usage), holds=dict(s.holds), client=b.client,
            adapter=None if b.adapter is None else proto.AdapterInfo(**b.adapter),
            report_mapping=s.report_mapping, unmapped_pages=s.unmapped_pages, phase=s.phase,
        )

    def _snapshot(self) -> Snapshot:
        ledger = self._ledger
        return Snapshot(
            device_uuid=ledger.device.uuid,
            sessions=[self._session_record(sid) for sid in ledger.sessions],
            limits=[limit_record(name, limits) for name, limits in ledger.limits.items()],
            fenced=[FenceRecord(token=token, session_id=sid) for token, sid in self._table.fenced.items()],
        )

    # -------------------------------------------------------------- replay
    def restore(self) -> Restored:
        """Read the state directory into limits and fences, and return the sessions to restore.

        The caller restores the sessions whose processes are alive (:func:`restore_session`),
        then calls :meth:`started` so that the journal starts empty.
        """
        loaded = self.store.open()
        snap, records = loaded.snapshot, loaded.records
        device_uuid = self._ledger.device.uuid
        if snap is not None and snap.device_uuid != device_uuid:
            log.warning(
                "event=state_device_mismatch state_uuid=%s device_uuid=%s detail=state_ignored",
                snap.device_uuid, device_uuid,
            )
            snap, records = None, []
        sessions, limits, fenced = replay(snap, records)
        for name, limit in limits.items():
            self._ledger.restore_limits(name, limits_of(limit))
        self._table.fenced.update(fenced)
        if loaded.secret_problem is not None:
            log.warning("event=state_secret_problem state_dir=%s detail=%r", self.store.state_dir, loaded.secret_problem)
        return Restored(list(sessions.values()), _damage(loaded), found_state=snap is not None or bool(records),
                        secret=loaded.secret)


def _damage(loaded: LoadedState) -> dict[str, Any] | None:
    """What the load found wrong (status ``broker.state_damage``), or None.  ``records_lost``:
    whole records may be gone (anything but a torn tail), so that the broker cannot tell which
    processes held memory (``RequestCore``)."""
    if not (loaded.damaged or loaded.torn_bytes):
        return None
    return {
        "damaged_records": loaded.damaged_records,
        "damaged_bytes": loaded.damaged_bytes,
        "torn_bytes": loaded.torn_bytes,
        "snapshot": loaded.snapshot_damage,
        "missing": list(loaded.missing),
        "lost_records": loaded.lost_records,
        "records_lost": loaded.damaged,
    }


def records_may_be_lost(damage: dict[str, Any]) -> bool:
    """Whether ``damage`` (as :func:`_damage` words it) may have taken whole records with it."""
    return bool(damage.get("records_lost", damage.get("damaged_records") or damage.get("damaged_bytes")
                             or damage.get("snapshot") or damage.get("missing") or damage.get("lost_records")))


def restore_session(ledger: Ledger, table: SessionTable, record: SessionRecord, now_s: float) -> None:
    """Put a session from the journal back in the ledger (``recovering``) and the table."""
    ledger.open_session(
        record.id, instance=record.instance, pid=record.pid, pid_verified=record.pid_verified,
        tp_rank=record.rank, tp_size=record.tp_size, page_bytes=record.page_bytes, now_s=now_s,
        pools=dict(record.pools), granted_pages=record.granted_pages, reserve_pages=record.reserve_pages,
        state=SessionState.RECOVERING, restored=True, holds=dict(record.holds),
        report_mapping=record.report_mapping, unmapped_pages=record.unmapped_pages, phase=record.phase,
    )
    ledger.sessions[record.id].usage = dict(record.usage)
    table.add(Binding(
        session_id=record.id, token=record.token, nonce=record.nonce, pid=record.pid,
        pid_verified=record.pid_verified, pid_start_ticks=record.pid_start_ticks, uid=record.uid,
        version=proto.PROTOCOL_VERSION, client=record.client,
        adapter=None if record.adapter is None else msgspec.structs.asdict(record.adapter),
    ))


def record_bytes(record: SessionRecord) -> int:
    return _charged_bytes(record.pools, record.holds, record.granted_pages, record.page_bytes)


def _charged_bytes(pools: dict[str, int], holds: dict[str, int], granted_pages: int, page_bytes: int) -> int:
    """What a journal record's holdings charge: pools, holds and granted pages."""
    return sum(pools.values()) + sum(holds.values()) + granted_pages * page_bytes


def limit_record(instance: str, limits: Limits) -> LimitRecord:
    """An instance's limits as the journal writes them: every field of :class:`Limits`, named."""
    return LimitRecord(instance=instance, **asdict(limits))


def limits_of(record: LimitRecord) -> Limits:
    """The limits a journal record holds (:func:`limit_record`'s inverse)."""
    return Limits(**{f.name: getattr(record, f.name) for f in fields(Limits)})


def replay(
    snap: Snapshot | None, records: list[JournalRecord]
) -> tuple[dict[str, SessionRecord], dict[str, LimitRecord], dict[str, str]]:
    """Sessions, limits and fences after applying the journal's records to the snapshot."""
    sessions = {r.id: r for r in snap.sessions} if snap else {}
    limits = {r.instance: r for r in snap.limits} if snap else {}
    fenced = {r.token: r.session_id for r in snap.fenced} if snap else {}
    apply: dict[type, Callable[[Any], object]] = {
        SessionRecord: lambda r: sessions.__setitem__(r.id, r),
        HoldRecord: lambda r: _apply_hold(sessions, r),
        CloseRecord: lambda r: sessions.pop(r.session_id, None),
        LimitRecord: lambda r: limits.__setitem__(r.instance, r),
        UnlimitRecord: lambda r: limits.pop(r.instance, None),
        FenceRecord: lambda r: fenced.__setitem__(r.token, r.session_id),
    }
    for record in records:
        apply[type(record)](record)
    return sessions, limits, fenced


def _apply_hold(sessions: dict[str, SessionRecord], record: HoldRecord) -> None:
    known = sessions.get(record.session_id)
    if known is not None:
        sessions[record.session_id] = msgspec.structs.replace(
            known, pools=record.pools, granted_pages=record.granted_pages,
            reserve_pages=record.reserve_pages, usage=record.usage, holds=record.holds,
            unmapped_pages=record.unmapped_pages, phase=record.phase,
        )
