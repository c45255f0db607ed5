"""The journal: what the ledger and the session table must not forget, on disk (no I/O elsewhere).

``Journal`` owns the state store (``checkpoint``) and the rule that keeps a restarted broker
from handing memory out twice: every change that adds a charge is written before the round
that made it is answered (group commit: :meth:`Journal.commit` once per round, before the
replies go out).  It also owns

* **deferral**: a round whose changes only *decrease* charges may wait up to ``DEFER_S`` for
  the next durable write.  Losing it in a crash over-charges until the worker re-asserts what
  it holds, which is safe;
* **no-op rounds**: a session that ends a round where its latest record left it (a page out
  and back) is not written at all, and a session that grows back to its latest *written*
  record while a decrease of it is deferred drops that decrease unwritten (pages released and
  taken again within the grace: what is on disk is right again);
* **snapshots** (when the journal passes its size limit, and at a clean stop);
* **replay** at start-up (:meth:`Journal.restore`), with the damage it found.

``NullJournal`` is the same interface for ``--no-state``: it forgets.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
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


class Holdings(NamedTuple):
    """What a session's journal ``hold`` record carries, copied out of the ledger."""

    granted_pages: int
    reserve_pages: int
    pools: dict[str, int]
    usage: dict[str, int]
    holds: dict[str, int]

    @classmethod
    def of(cls, session: Session) -> "Holdings":
        return cls(session.granted_pages, session.reserve_pages, dict(session.pools), dict(session.usage),
                   dict(session.holds))

    def still(self, session: Session) -> bool:
        """Whether ``session`` holds exactly this (compared in place, without copying)."""
        return self == (session.granted_pages, session.reserve_pages, session.pools, session.usage, session.holds)

    def record(self, session_id: str) -> HoldRecord:
        return HoldRecord(session_id=session_id, pools=self.pools, granted_pages=self.granted_pages,
                          reserve_pages=self.reserve_pages, usage=self.usage, holds=self.holds)


@dataclass
class Restored:
    """What a journal replay found: the state, and any damage it had to skip."""

    sessions: list[SessionRecord] = field(default_factory=list)
    damage: dict[str, Any] | None = None  # None: the state was read whole
    found_state: bool = False


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
        # carries (None: not known here, so the next change is written in full).
        self._on_disk: dict[str, Holdings | None] = {}
        # Decrease-only records not yet written, the latest per session (each supersedes the
        # one before), and the holdings each of those sessions' latest written record carries.
        self._deferred: dict[str, HoldRecord] = {}
        self._written_before: dict[str, Holdings | None] = {}
        self._defer_until_s = 0.0

    # ------------------------------------------------------------- writing
    def fence(self, token: str, session_id: str) -> None:
        """An evicted session's token: refused from then on, across restarts too."""
        self._pending.append(FenceRecord(token=token, session_id=session_id))

    def rewrite(self, session_id: str) -> None:
        """Write this session's whole record with its next change (its identity changed)."""
        self._on_disk.pop(session_id, None)
        self._written_before.pop(session_id, None)

    def commit(self, now_s: float) -> None:
        """Write what the ledger changed this round; call before the round's replies go out."""
        changes = self._ledger.drain_changes()
        if changes is None and not self._pending:
            return
        records, self._pending = self._pending, []
        durable_now = bool(records)  # fences
        if changes is not None:
            durable_now |= changes.grew or bool(changes.closed or changes.limits)
            durable_now |= self._session_records(changes.sessions, records)
            for session_id in changes.closed:
                records.append(CloseRecord(session_id=session_id))
                self._on_disk.pop(session_id, None)
            for instance in changes.limits:
                limits = self._ledger.limits.get(instance)
                records.append(limit_record(instance, limits) if limits else UnlimitRecord(instance=instance))
        if not records:
            return
        if durable_now:
            self._write(records)
            return
        if not self._deferred:
            self._defer_until_s = now_s + DEFER_S
        for record in records:  # decrease-only rounds carry hold records alone
            assert isinstance(record, HoldRecord)
            self._deferred[record.session_id] = record

    def _session_records(self, session_ids: set[str], records: list[JournalRecord]) -> bool:
        """Append a record per changed session; True if one of them is a whole new record."""
        whole = False
        on_disk = self._on_disk
        written_before = self._written_before
        deferred = self._deferred
        sessions = self._ledger.sessions
        for session_id in session_ids:
            session = sessions[session_id]
            last = on_disk.get(session_id)
            if last is not None and last.still(session):
                continue  # back to what the journal already says (say, one page out and back)
            written = written_before.get(session_id)
            if written is not None and written.still(session):
                del deferred[session_id]  # back to what is written: its decrease is moot
                del written_before[session_id]
                on_disk[session_id] = written
                continue
            holdings = Holdings.of(session)
            if deferred:
                deferred.pop(session_id, None)  # this round's record supersedes it
            if session_id in on_disk:  # the rest of its record is already on disk
                written_before.setdefault(session_id, last)
                records.append(holdings.record(session_id))
            else:
                records.append(self._session_record(session_id))
                whole = True
            on_disk[session_id] = holdings
        return whole

    def flush_due(self, now_s: float) -> bool:
        """Write deferred records whose grace has passed; True if it wrote."""
        if self._deferred and now_s >= self._defer_until_s:
            self._write([])
            return True
        return False

    def flush(self) -> None:
        self._write([])

    def _write(self, records: list[JournalRecord]) -> None:
        batch = [*self._deferred.values(), *records]
        self._deferred = {}
        self._written_before.clear()
        if not batch:
            return
        self.store.append(batch)
        if self.store.needs_compaction():
            self.write_snapshot()

    def write_snapshot(self) -> None:
        self.store.write_snapshot(self._snapshot())
        self._on_disk = dict.fromkeys(self._ledger.sessions)
        self._written_before.clear()

    def started(self) -> None:
        """After a restore: what it rebuilt is the new snapshot, and the journal starts empty."""
        self._ledger.drain_changes()
        self.write_snapshot()

    def close(self) -> None:
        """A clean stop: everything written, one snapshot, the journal empty."""
        try:
            self.commit(0.0)
            self.flush()
            self.write_snapshot()
        except Exception as exc:  # keep the journal; it is enough to recover
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
            self._ledger.restore_limits(
                name, Limits(limit.max_bytes, limit.min_bytes, limit.weight, limit.revision, limit.source)
            )
        self._table.fenced.update(fenced)
        return Restored(list(sessions.values()), _damage(loaded), found_state=snap is not None or bool(records))


def _damage(loaded: LoadedState) -> dict[str, Any] | None:
    if not (loaded.damaged or loaded.torn_bytes):
        return None
    return {
        "damaged_records": loaded.damaged_records,
        "damaged_bytes": loaded.damaged_bytes,
        "torn_bytes": loaded.torn_bytes,
        "snapshot": loaded.snapshot_damage,
    }


def restore_session(ledger: Ledger, table: SessionTable, record: SessionRecord, now_s: float) -> None:
    """Put a session from the journal back in the ledger (``recovering``) and the table."""
    ledger.open_session(
        record.id, instance=record.instance, pid=record.pid, pid_verified=record.pid_verified,
        tp_rank=record.rank, tp_size=record.tp_size, page_bytes=record.page_bytes, now_s=now_s,
        pools=dict(record.pools), granted_pages=record.granted_pages, reserve_pages=record.reserve_pages,
        state=SessionState.RECOVERING, restored=True, holds=dict(record.holds),
    )
    ledger.sessions[record.id].usage = dict(record.usage)
    table.add(Binding(
        session_id=record.id, token=record.token, nonce=record.nonce, pid=record.pid,
        pid_verified=record.pid_verified, pid_start_ticks=record.pid_start_ticks, uid=record.uid,
        version=proto.PROTOCOL_VERSION, client=record.client,
        adapter=None if record.adapter is None else msgspec.structs.asdict(record.adapter),
    ))


def record_bytes(record: SessionRecord) -> int:
    return sum(record.pools.values()) + sum(record.holds.values()) + record.granted_pages * record.page_bytes


def limit_record(instance: str, limits: Limits) -> LimitRecord:
    return LimitRecord(instance=instance, max_bytes=limits.max_bytes, min_bytes=limits.min_bytes,
                       weight=limits.weight, revision=limits.revision, source=limits.source)


def replay(
    snap: Snapshot | None, records: list[JournalRecord]
) -> tuple[dict[str, SessionRecord], dict[str, LimitRecord], dict[str, str]]:
    """Sessions, limits and fences after applying the journal's records to the snapshot."""
    sessions = {r.id: r for r in snap.sessions} if snap else {}
    limits = {r.instance: r for r in snap.limits} if snap else {}
    fenced = {r.token: r.session_id for r in snap.fenced} if snap else {}
    apply: dict[type, Callable[[Any], None]] = {
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
        )
