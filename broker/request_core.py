"""The broker's request layer, sans I/O: bytes and a clock value in, bytes out (the h11 style).

:meth:`RequestCore.handle` takes one request frame from one peer and returns the reply
frame.  It opens no socket or file and reads no clock; process checks, kills and pid watches
go through an injected :class:`~.lifecycle.ProcessOps`, the admin check is an injected
function, and what must reach disk goes to the journal, which the shell commits once per
round before it sends the round's replies.  Pushes (pressure asks) wait in an outbox the
shell drains with :meth:`take_pushes`.

Anything a peer sends gets a reply or is dropped: an exception other than a ``BrokerError``
escaping :meth:`handle` is a bug (it is answered ``internal`` and logged).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable

import msgspec

from ..client import protocol as proto
from ..client import results
from ..client.credit import split_grant
from ..client.errors import BrokerError, NotOwner, SessionEvicted, UnknownSession
from .admin_ops import AdminOps
from .checkpoint import StateStore
from .config import DEFAULT_HEADROOM
from .counters import Counters
from .device import DeviceProbe
from .device_monitor import DeviceMonitor
from .journal import Journal, NullJournal, Restored, record_bytes, records_may_be_lost, restore_session
from .accounts import Grant, Refusal, Session, SessionState
from .ledger import Ledger
from .lifecycle import ProcessOps, SessionLifecycle
from .policy import Ask, PressureBook, fair_shares
from .security import Peer
from .quotas import SessionQuotas
from .refusal_errors import refusal_of
from .session_opener import SessionOpener
from .sessions import Binding, SessionTable
from .status import build_status
from .waiting import WaitingAsk, WaitingAsks

log = logging.getLogger("kvcached_broker")

#: At most one device reading per this many seconds on behalf of pressure planning.
PRESSURE_READ_S = 0.05
#: At most one device reading per this many seconds on behalf of asks waiting for memory that
#: a release (not yet shown by the last reading) may have freed.
WAITING_READ_S = 0.002

_decode_request = msgspec.msgpack.Decoder(proto.AnyRequest).decode
_encode = msgspec.msgpack.Encoder().encode
_LIVE = SessionState.LIVE  # bound once: no enum member lookup per request (docs/performance.md)


class _Retried(Exception):
    """A request id the session was already answered for: send ``reply`` again, apply nothing."""

    def __init__(self, reply: bytes):
        super().__init__()
        self.reply = reply


class RequestCore:
    """Decides every request against the ledger and the session table."""

    def __init__(
        self,
        ledger: Ledger,
        journal: Journal | NullJournal,
        device: DeviceMonitor,
        processes: ProcessOps,
        is_admin: Callable[[Peer], bool],
        quotas: SessionQuotas,
        table: SessionTable,
        meta: dict[str, Any] | None = None,
        started_s: float = 0.0,
    ):
        self.ledger = ledger
        self.journal = journal
        self.device = device
        self.table = table
        self.quotas = quotas
        self.counters = Counters()
        self.pressure = PressureBook()
        self._pressure_read_s = -1.0
        self.waiting = WaitingAsks()
        self._waiting_read_s = -1.0
        self._freed_since_read = False  # a release or unmapping since the last reading for waiting asks
        self.lifecycle = SessionLifecycle(ledger, table, self.pressure, processes, self.counters)
        self.opener = SessionOpener(ledger, table, self.lifecycle, journal, quotas,
                                    broker_start_ticks=processes.start_ticks(os.getpid()))
        self.admin = AdminOps(ledger, self.lifecycle, journal, device, is_admin)
        self.meta = dict(meta or {})
        self.started_s = started_s
        self.state_damage: dict[str, Any] | None = None  # what the restore found damaged
        self._hold_until_s = 0.0  # growth held (damaged state) until then at the latest
        #: The damage may have taken whole records: nobody can say which processes held memory,
        #: so the hold lasts until ``_hold_until_s`` (every live worker re-asserts well within it).
        self._records_lost = False
        self._pushes: list[tuple[bytes, bytes]] = []
        #: The shell's bounds and what they met (open files, connections...), for status.
        self.shell_view: Callable[[], dict[str, Any]] | None = None
        self._body = b""  # the frame being handled: the reply cache fingerprints it
        self._handlers: dict[type, Callable[[Any, bytes, Peer, float], bytes | None]] = {
            proto.Hello: self.opener.hello,
            proto.Reserve: self._reserve,
            proto.Acquire: self._acquire,
            proto.Release: self._release,
            proto.Mapped: self._mapped,
            proto.Heartbeat: self._heartbeat,
            proto.Close: self._close,
            proto.Status: self._status,
            proto.SetLimit: self.admin.set_limit,
            proto.Evict: self.admin.evict,
            proto.Simulate: self.admin.simulate,
        }

    # -------------------------------------------------------------- requests
    def handle(self, rid: bytes, peer: Peer, body: bytes, now: float) -> bytes | None:
        """The reply to one request frame from the connection ``rid`` of ``peer``."""
        try:
            request = _decode_request(body)  # the socket's MAXMSGSIZE already bounds its size
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            self.counters.bad_frames += 1
            try:
                proto.decode_request(body)
            except proto.ProtocolError as exc:  # the full path, for its one-line reason and the id
                return proto.error_reply(exc.request_id, "bad_request", str(exc))
            return proto.error_reply(None, "bad_request", "invalid request")
        self._body = body
        try:
            return self._handlers[type(request)](request, rid, peer, now)
        except _Retried as retried:
            return retried.reply
        except BrokerError as exc:
            self.counters.refused(exc.code)
            return proto.error_reply(request.id, exc.code, exc.message, exc.details)
        except Exception:
            log.exception("event=internal_error op=%s", type(request).__name__)
            return proto.error_reply(request.id, "internal", "internal broker error; the request was not applied")

    def has_pushes(self) -> bool:
        return bool(self._pushes)

    def take_pushes(self) -> list[tuple[bytes, bytes]]:
        """Messages to send unasked, as ``(routing id, frame)``: pressure asks."""
        pushes, self._pushes = self._pushes, []
        return pushes

    def reclaim_pid(self, pid: int) -> None:
        """The process ``pid`` exited: free every session it held."""
        self.lifecycle.reclaim_pid(pid)

    def _refusal_for_token(self, token: str, binding: Binding | None) -> BrokerError:
        """Why a request with ``token`` may not drive a session from its connection."""
        if binding is not None:
            return NotOwner(
                f"session {binding.session_id} is bound to another connection; its owner may resume it with hello",
                details={"session_id": binding.session_id, "resume": True},
            )
        if token in self.table.fenced:
            return SessionEvicted(
                f"session {self.table.fenced[token]} was evicted by an operator; its memory has been given away"
            )
        return UnknownSession("unknown session; open a new one with hello")

    def _session_request(self, token: str, request_id: int, rid: bytes, now: float, *,
                         reserve_pages: int | None = None, idle_pages: int | None = None) -> tuple[Binding, Session]:
        """The binding and ledger session of the request ``request_id`` carrying ``token``, with
        its lease renewed and the news the request brings taken (the client's credit reserve, its
        idle pages; None: the request does not say).

        A retried request (an id this session has been answered for) raises :class:`_Retried`
        carrying that first answer, so it is never applied twice.
        """
        binding = self.table.by_token(token)
        if binding is None or binding.routing_id != rid:
            raise self._refusal_for_token(token, binding)
        session = self.ledger.sessions[binding.session_id]
        session.last_seen_s = now
        if request_id in binding.replies or request_id <= binding.forgotten_id:
            cached = binding.replay(request_id, hash(self._body))
            if cached is not None:
                raise _Retried(cached)
        if session.state is not _LIVE and self.ledger.touch(session.id, now):
            log.info("event=session_live session=%s detail=lease_renewed", session.id)
        if reserve_pages is not None and reserve_pages != session.reserve_pages:
            self.ledger.set_reserve_pages(session.id, reserve_pages)
        if idle_pages is not None:
            session.idle_pages = idle_pages
        return binding, session

    def _answer(self, binding: Binding, request_id: int, result: results.Result) -> bytes:
        reply = _encode(proto.Reply(id=request_id, ok=True, result=result))
        binding.remember_reply(request_id, hash(self._body), reply, self.table.reply_cache)
        return reply

    def _reserve(self, req: proto.Reserve, rid: bytes, peer: Peer, now: float) -> bytes:
        binding, session = self._session_request(req.session, req.id, rid, now)
        if req.measured_base:
            self.device.observe(self.ledger, now)  # pin what the device says now, not a reading ago
        try:
            pools = self.ledger.reserve(
                session.id, dict(req.pools), None if req.usage is None else dict(req.usage),
                holds=None if req.holds is None else dict(req.holds), measured_base=req.measured_base,
                min_holds=None if req.min_holds is None else dict(req.min_holds), phase=req.phase,
            )
        except BrokerError as exc:
            log.info("event=refusal session=%s op=reserve code=%s detail=%r", binding.session_id, exc.code, exc.message)
            reply = proto.error_reply(req.id, exc.code, exc.message, exc.details)
            binding.remember_reply(req.id, hash(self._body), reply, self.table.reply_cache)
            self.counters.refused(exc.code)
            refusal = refusal_of(exc)
            if refusal is not None:
                self._press_for(session.instance, refusal.asked_bytes, refusal, now)
            return reply
        result = results.ReserveResult(
            pools=pools, holds=dict(session.holds), reserved_bytes=session.reserved_bytes,
            measured_bytes=self.ledger.measured_bytes(session.id),
            grantable_bytes=self.ledger.grantable_bytes(session.instance),
            ever_bytes=self.ledger.ever_bytes(session.instance),
        )
        if req.min_holds is not None:  # a worker sizing its start-up: who holds the rest, for its messages
            result.holders = [results.Holder(instance=name, charged_bytes=size)
                              for name, size in self.ledger.top_charges(exclude=session.instance)]
        return self._answer(binding, req.id, result)

    def _acquire(self, req: proto.Acquire, rid: bytes, peer: Peer, now: float) -> bytes | None:
        binding, session = self._session_request(req.session, req.id, rid, now, reserve_pages=req.reserve_pages,
                                                 idle_pages=req.idle_pages)
        if self.waiting and self.waiting.waiting(session.id, req.id):
            return None  # a resend of an ask that waits: it is answered once, when it ends
        if req.mapped and session.report_mapping:
            self.device.observe(self.ledger, now)  # mapped pages are covered only by what a reading shows now
        self.pressure.note_active(session.instance, now)
        grant = self.ledger.acquire(session.id, req.pages, req.min_pages, req.mapped)
        if grant.refusal is not None and req.wait_s and grant.refusal.for_room:
            self._wait(req, session, now)
            return None
        return self._granted(binding, session, req.id, grant, req.pages, req.min_pages, req.caller_pages,
                             req.caller_min_pages, now, hash(self._body))

    def _granted(self, binding: Binding, session: Session, request_id: int, grant: Grant, pages: int,
                 min_pages: int | None, caller_pages: int | None, caller_min_pages: int | None, now: float,
                 body_hash: int, waited_s: float | None = None) -> bytes:
        """The reply to an ``acquire`` (granted or refused), cached; a refusal may press others.
        ``waited_s``: how long the ask waited for memory (said in the reply)."""
        if caller_pages is not None:  # the client's reserve after this grant, as it books it
            _, reserve_after = split_grant(session.reserve_pages, grant.pages, caller_pages, caller_min_pages)
            self.ledger.set_reserve_pages(session.id, reserve_after)
        result = results.AcquireResult(granted=grant.pages, granted_pages=session.granted_pages)
        if waited_s is not None:
            result.waited_s = round(waited_s, 6)
        if grant.refusal is not None:
            refusal = grant.refusal
            log.info("event=refusal session=%s op=acquire code=%s detail=%r", binding.session_id, refusal.code, refusal.message)
            self.counters.refused(refusal.code)
            result.refused = proto.ErrorBody(code=refusal.code, message=refusal.message, details=refusal.details)
            floor_pages = pages if min_pages is None else max(1, min_pages)
            self._press_for(session.instance, floor_pages * session.page_bytes, refusal, now)
        else:
            self.counters.grants += 1
        reply = _encode(proto.Reply(id=request_id, ok=True, result=result))
        binding.remember_reply(request_id, body_hash, reply, self.table.reply_cache)
        return reply

    def _wait(self, req: proto.Acquire, session: Session, now: float) -> None:
        """Park a refused ask until memory comes back, and ask the others for all of it at once."""
        assert req.wait_s is not None
        self.waiting.add(WaitingAsk(session.id, req.id, hash(self._body), req.pages, req.min_pages, req.mapped,
                                    req.caller_pages, req.caller_min_pages, now, now + req.wait_s))
        free = self.ledger.fit_pages(session.id, req.pages, req.mapped) * session.page_bytes
        self._plan_pressure(session.instance, req.pages * session.page_bytes - free, now)

    def serve_waiting(self, now: float) -> None:
        """Grant the asks that fit now, the most starved instance's first; answer those whose
        time is up with their refusal.  The replies go to the outbox (sent after the journal
        commit of this round).  Cheap when nothing waits."""
        if not self.waiting:
            return
        if self._freed_since_read and now - self._waiting_read_s >= WAITING_READ_S:
            # A release's pages may still show in the last reading (charged as measured): read
            # the device, so that what came back is seen in the round it came back.
            self._waiting_read_s = now
            self._freed_since_read = False
            self.device.observe(self.ledger, now)
        shares = fair_shares(self.ledger)
        asks = self.waiting.all()
        asks.sort(key=lambda a: self._starvation(a, shares))
        for ask in asks:
            binding = self.table.by_id(ask.session_id)
            session = self.ledger.sessions.get(ask.session_id)
            if binding is None or session is None:
                self.waiting.remove(ask)  # its session ended: nobody to answer
                continue
            fits = self.ledger.fit_pages(session.id, ask.pages, ask.mapped)
            if fits < ask.floor_pages and now < ask.deadline_s:
                continue
            self.waiting.remove(ask)
            grant = self.ledger.acquire(session.id, ask.pages, ask.min_pages, ask.mapped)
            if grant.refusal is None:
                log.info("event=waited session=%s instance=%s pages=%d waited_s=%.3f", session.id, session.instance,
                         grant.pages, now - ask.since_s)
            reply = self._granted(binding, session, ask.request_id, grant, ask.pages, ask.min_pages, ask.caller_pages,
                                  ask.caller_min_pages, now, ask.body_hash, waited_s=now - ask.since_s)
            if binding.routing_id is not None:
                self._pushes.append((binding.routing_id, reply))

    def _starvation(self, ask: WaitingAsk, shares: dict[str, int]) -> tuple[int, float]:
        session = self.ledger.sessions.get(ask.session_id)
        if session is None:
            return 0, ask.since_s
        return self.ledger.instance_charge_bytes(session.instance) - shares.get(session.instance, 0), ask.since_s

    def _release(self, req: proto.Release, rid: bytes, peer: Peer, now: float) -> bytes:
        binding, session = self._session_request(req.session, req.id, rid, now, reserve_pages=req.reserve_pages,
                                                 idle_pages=req.idle_pages)
        if req.mapped_pages is not None and req.mapped_pages != session.mapped_pages:
            self.device.observe(self.ledger, now)  # a mapping change against a fresh reading (see _mapped)
        remaining = self.ledger.release(session.id, req.pages, req.mapped_pages)
        if self.pressure.pending:
            self.pressure.on_release(session.id, req.pages)
        if self.waiting:
            self._freed_since_read = True
            self.serve_waiting(now)
        result = results.ReleaseResult(granted_pages=remaining)
        if session.report_mapping:
            result.unmapped_pages = session.unmapped_pages
        return self._answer(binding, req.id, result)

    def _mapped(self, req: proto.Mapped, rid: bytes, peer: Peer, now: float) -> bytes:
        """Pages the session mapped or unmapped, against a device reading made now: a page comes
        off the promised charge only once a reading can show it (the last periodic one may not
        yet), and a page unmapped goes back on it as the reading stops showing it (else it would
        be charged twice, measured and promised, until the next periodic reading)."""
        binding, session = self._session_request(req.session, req.id, rid, now, reserve_pages=req.reserve_pages,
                                                 idle_pages=req.idle_pages)
        if session.report_mapping and req.mapped_pages != session.mapped_pages:
            self.device.observe(self.ledger, now)
        unmapped = self.ledger.set_mapped(session.id, req.mapped_pages)
        if self.waiting:
            self._freed_since_read = True
            self.serve_waiting(now)
        return self._answer(binding, req.id, results.MappedResult(granted_pages=session.granted_pages,
                                                                  unmapped_pages=unmapped))

    def _heartbeat(self, req: proto.Heartbeat, rid: bytes, peer: Peer, now: float) -> bytes:
        binding, session = self._session_request(req.session, req.id, rid, now, reserve_pages=req.reserve_pages,
                                                 idle_pages=req.idle_pages)
        return self._answer(binding, req.id, results.HeartbeatResult(state=session.state.value,
                                                                     granted_pages=session.granted_pages))

    def _close(self, req: proto.Close, rid: bytes, peer: Peer, now: float) -> bytes:
        binding, _ = self._session_request(req.session, req.id, rid, now)
        freed = self.lifecycle.end(binding, cause="closed")
        return proto.ok_reply(req.id, results.CloseResult(closed=binding.session_id, freed_bytes=freed))

    def _status(self, req: proto.Status, rid: bytes, peer: Peer, now: float) -> bytes:
        if req.session is not None:
            try:
                # renews the lease (a status is never cached)
                self._session_request(req.session, req.id, rid, now, reserve_pages=req.reserve_pages)
            except _Retried:
                pass
        return proto.ok_reply(req.id, self.status(now))

    def _press_for(self, instance: str, asked_bytes: int, refusal: Refusal, now: float) -> None:
        """A refused instance: ask those above their share (if it is below its floor or share),
        then idle pages elsewhere, for what the ask lacked."""
        if refusal.code != "budget_exceeded" or refusal.held:
            return  # its own cap, external overcommit or a recovery hold: taking from others would not help
        self._plan_pressure(instance, asked_bytes - refusal.free_bytes, now)

    def _plan_pressure(self, instance: str, need_bytes: int, now: float) -> None:
        if need_bytes <= 0:
            return
        if now - self._pressure_read_s >= PRESSURE_READ_S:
            # What others were asked for before may be unmapped already: read the device, so
            # that their excess is not a reading old and they are not asked for it twice.
            self._pressure_read_s = now
            self.device.observe(self.ledger, now)
        self._push(self.pressure.plan(self.ledger, instance, need_bytes, now, self._reachable), instance)

    def replenish(self, now: float) -> None:
        """The watermarks (a timer): keep memory free for instances below their share."""
        if self.ledger.sessions:
            self._push(self.pressure.replenish(self.ledger, now, self._reachable), "")

    def _reachable(self, session_id: str) -> bool:
        binding = self.table.by_id(session_id)
        return binding is not None and binding.routing_id is not None

    def _push(self, asks: list[Ask], for_instance: str) -> None:
        for ask in asks:
            binding = self.table.by_id(ask.session_id)
            if binding is None or binding.routing_id is None:
                continue
            reason = f"{for_instance} is below its share" if ask.kind == "share" else (
                f"{for_instance} needs memory; give back idle pages" if for_instance
                else "keeping memory free for instances below their share")
            push = proto.Pressure(session_id=ask.session_id, pages=ask.pages, reason=reason, soft=ask.soft)
            self._pushes.append((binding.routing_id, proto.encode(push)))
            log.info(
                "event=pressure for=%s session=%s instance=%s priority=%d kind=%s pages=%d bytes=%d",
                for_instance or "-", ask.session_id, ask.instance, ask.priority, ask.kind, ask.pages,
                ask.pages * ask.page_bytes,
            )

    # ---------------------------------------------------------------- time
    def expire_leases(self, now: float) -> None:
        """Sessions silent past the lease turn stale (and stay charged)."""
        for session in self.ledger.expire_leases(now, self.quotas.lease_s):
            log.warning(
                "event=session_stale session=%s instance=%s pid=%d idle_s=%.1f charged_bytes=%d",
                session.id, session.instance, session.pid, now - session.last_seen_s, session.reported_bytes,
            )

    def expire_pressure(self, now: float) -> None:
        if self.pressure.pending:
            for session_id, ask in self.pressure.expire(now):
                log.warning(
                    "event=pressure_ignored session=%s instance=%s outstanding_pages=%d detail=still_charged",
                    session_id, ask.instance, ask.outstanding_pages,
                )

    def lift_growth_hold(self, now: float) -> None:
        """A hold after damaged state ends when its time is up (twice the lease), or before then
        once no restored session waits for its worker (``recovering``, or ``stale`` without
        having resumed) if the damage took no whole record (a torn tail).  When records may be
        lost, the broker cannot tell which live processes had sessions, so it waits the time
        within which every live client talks to it (a heartbeat each quarter lease) and, finding
        its session lost, re-asserts."""
        if self.ledger.growth_hold is None:
            return
        if now >= self._hold_until_s or (not self._records_lost and not self.awaiting_workers()):
            log.warning("event=growth_hold_lifted recovering_sessions=%d awaiting_workers=%d records_lost=%s",
                        self.recovering(), self.awaiting_workers(), self._records_lost)
            self.ledger.release_growth()
            self._records_lost = False

    def recovering(self) -> int:
        return sum(1 for s in self.ledger.sessions.values() if s.state is SessionState.RECOVERING)

    def awaiting_workers(self) -> int:
        """Restored sessions whose worker has not resumed them since the restart."""
        return sum(1 for s in self.ledger.sessions.values() if s.restored)

    # -------------------------------------------------------------- restore
    def restore(self, restored: Restored, now: float) -> None:
        """Bring back the sessions a journal replay found, except those whose process is gone."""
        processes = self.lifecycle.processes
        kept = dropped = 0
        if restored.secret is not None:
            self.opener.tokens.rekey(restored.secret)  # tokens issued before this start verify again
        for record in restored.sessions:
            self.opener.spend(record.id)
            if record.pid_verified and not processes.alive(record.pid, record.pid_start_ticks):
                dropped += 1
                self.counters.reclaimed("exited_while_down")
                log.info(
                    "event=session_end cause=exited_while_down session=%s instance=%s pid=%d freed_bytes=%d",
                    record.id, record.instance, record.pid, record_bytes(record),
                )
                continue
            restore_session(self.ledger, self.table, record, now)
            kept += 1
        if restored.found_state:
            log.info("event=recovered sessions=%d dropped=%d", kept, dropped)
        if restored.damage is not None:
            self._distrust(restored.damage, now)

    def _distrust(self, damage: dict[str, Any], now: float) -> None:
        """Damaged or cut-short state may under-count what the restored sessions hold, and
        damage that took whole records (a session's own record, a deleted file) leaves processes
        that hold memory with no session at all.  Nobody else grows until the restored sessions'
        workers have re-asserted (a torn tail: nothing answered was lost), or for twice the lease
        when records may be lost.  Meanwhile the memory re-asserted (within each allowance, to
        a verified token) is charged whether or not it fits, and each live registered process
        is charged at least what the device measures it using, as always."""
        hold_s = 2 * self.quotas.lease_s
        self.state_damage = damage
        self._records_lost = records_may_be_lost(damage)
        log.warning(
            "event=state_damaged damaged_records=%d damaged_bytes=%d torn_bytes=%d snapshot=%r missing=%s "
            "lost_records=%d records_lost=%s detail=growth_held_until_%s",
            damage.get("damaged_records", 0), damage.get("damaged_bytes", 0), damage.get("torn_bytes", 0),
            damage.get("snapshot"), ",".join(damage.get("missing", [])) or "-", damage.get("lost_records", 0),
            self._records_lost,
            f"{hold_s:.0f}s_have_passed" if self._records_lost else f"restored_sessions_reassert_or_{hold_s:.0f}s",
        )
        if self._records_lost:
            self.ledger.hold_growth(
                "the broker restarted from damaged state that may have lost whole records; it waits for every "
                "worker to re-assert what it holds", records_lost=True)
            for session in self.ledger.sessions.values():  # their records may be older than what they hold
                self.ledger.allow_reassertion(session.id, self.ledger.budget_bytes)
        else:
            self.ledger.hold_growth("the broker restarted from damaged state and waits for its workers to re-assert "
                                    "what they hold")
        self._hold_until_s = now + hold_s

    # --------------------------------------------------------------- status
    def status(self, now: float) -> results.StatusDocument:
        broker_meta = {
            **self.meta,
            "protocol": proto.PROTOCOL_VERSION,
            "uptime_s": round(now - self.started_s, 3),
            "lease_s": self.quotas.lease_s,
            "recovering_sessions": self.recovering(),
            "state_damage": self.state_damage,
            "growth_held": self.ledger.growth_hold,
            "hello_limits": {"max_floor_share": self.quotas.hello_max_floor_share,
                             "max_weight": self.quotas.hello_max_weight,
                             "max_priority": self.quotas.hello_max_priority},
            "state_writes": self.journal.write_status(),
            "limits": self.shell_view() if self.shell_view is not None else None,
            "counters": self.counters.to_dict(),
        }
        shares = fair_shares(self.ledger)

        page_bytes = {s.id: s.page_bytes for s in self.ledger.sessions.values()} if self.waiting else {}

        def policy_view(instance: str) -> tuple[int, results.PressureView]:
            view = self.pressure.instance_view(instance)
            if self.waiting:
                ids = {s.id for s in self.ledger.sessions.values() if s.instance == instance}
                view.waiting_asks, view.waiting_bytes = self.waiting.of_instance_bytes(page_bytes, ids)
            return shares.get(instance, 0), view

        return build_status(self.ledger, self.table, broker_meta, now, policy_view)



def build_core(
    probe: DeviceProbe,
    processes: ProcessOps,
    *,
    headroom: str = DEFAULT_HEADROOM,
    is_admin: Callable[[Peer], bool] = lambda peer: False,
    quotas: SessionQuotas = SessionQuotas(),
    state_dir: Path | None = None,
    device_index: int = 0,
    meta: dict[str, Any] | None = None,
    started_s: float = 0.0,
) -> RequestCore:
    """A request core for one device and its collaborators (the journal only with ``state_dir``).

    Nothing here opens a file: with a ``state_dir``, :meth:`Journal.restore` does, when the
    caller restores.
    """
    device = DeviceMonitor(probe, headroom)
    ledger = device.new_ledger()
    table = SessionTable()
    journal: Journal | NullJournal = (
        Journal(StateStore(state_dir, device_index), ledger, table) if state_dir is not None else NullJournal(ledger, table)
    )
    return RequestCore(ledger, journal, device, processes, is_admin, quotas, table, meta, started_s)
