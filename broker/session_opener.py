"""``hello``: who may open a session, resume one, or get the same one again (no I/O of its own).

* A hello is refused for an unknown protocol version, a pid that is not the connection's (the
  kernel's peer credentials), or a GPU that is not this broker's.
* The same nonce from the same process gets the same session (a retried hello; the client
  sends a hello whose answer it never got again with the same nonce).  After a restart, a
  hello that had resumed a session before it is a resume again: its claims are adopted anew.
* ``resume=token`` from the session's own process re-binds it to the new connection.  A
  session restored from the journal adopts the holdings the worker re-asserts, through
  admission, and answers the ids the worker names as ``settled`` from its reply cache.
* Otherwise a new session opens, empty whatever the hello claims, within the per-peer hello
  rate and the session quotas (in total, per pid, per uid).  Its token is one the broker can
  verify later without its record (``tokens``).  While growth is held after damaged state, a
  new session opened by a resume hello (its record was lost) may grow back by what that hello
  claimed, and no more (``Ledger.allow_reassertion``), but only if its token verifies: issued
  by this broker's secret to this very process, for a session this broker incarnation did not
  issue itself, and not re-asserted already.  A made-up or borrowed token gets nothing; so does
  a process that started after this broker did (it cannot have held memory before it).
* Limits a hello asks for apply only where no admin or config has set any, only to an
  instance whose sessions all belong to the asker's uid (``forbidden`` otherwise: the session
  opens, the limits do not apply), within the bounds an admin sets (``SessionQuotas``: a floor
  of at most a share of the budget, a weight of at most a maximum; past them they are cut
  down), and leave with the instance, or as soon as a session of another uid joins it.  The
  hello's answer says what became of them (``hello_limits``).
"""

from __future__ import annotations

import logging

import msgspec
from msgspec import UNSET, UnsetType

from ..client import protocol as proto
from ..client import results
from ..client.results import HelloOutcome
from ..client.errors import BadRequest, BrokerError, NotOwner, RateLimited, SessionEvicted, UnsupportedVersion, WrongDevice
from .journal import NullJournal, Journal
from .accounts import Claim, Limits
from .ledger import Ledger
from .quotas import SessionQuotas
from .lifecycle import SessionLifecycle
from .security import Peer
from .sessions import Binding, HelloRateLimiter, SessionTable
from .tokens import SessionTokens, holder_of

log = logging.getLogger("kvcached_broker")


class SessionOpener:
    def __init__(self, ledger: Ledger, table: SessionTable, lifecycle: SessionLifecycle,
                 journal: Journal | NullJournal, quotas: SessionQuotas, *, broker_start_ticks: int | None = None,
                 tokens: SessionTokens | None = None):
        self.ledger = ledger
        self.table = table
        self.lifecycle = lifecycle
        self.journal = journal
        self.quotas = quotas
        #: When this broker process started (``/proc`` clock ticks): a process that started
        #: later never held memory from the broker whose state was lost.
        self.broker_start_ticks = broker_start_ticks
        self._hellos = HelloRateLimiter(quotas.hello_rate_per_s, quotas.hello_burst)
        #: Issues and verifies tokens; keyed by the state directory's secret once restored.
        self.tokens = tokens if tokens is not None else SessionTokens()
        #: Session ids that may no longer earn a re-assertion allowance while growth is held:
        #: those this broker issued itself (a token of one is no lost record), and lost ones
        #: already re-asserted once.
        self._spent_ids: set[str] = set()

    def hello(self, req: proto.Hello, rid: bytes, peer: Peer, now: float) -> bytes:
        version = max((v for v in req.versions if v in proto.SUPPORTED_VERSIONS), default=None)
        if version is None:
            raise UnsupportedVersion(
                f"client speaks protocol {sorted(req.versions)}, broker speaks {list(proto.SUPPORTED_VERSIONS)}",
                details={"supported": list(proto.SUPPORTED_VERSIONS)},
            )
        if peer.pid_known and req.pid != peer.pid:
            raise NotOwner(f"hello claims pid {req.pid} but the connection belongs to pid {peer.pid}")
        device = self.ledger.device
        if req.device_uuid and req.device_uuid != device.uuid:
            raise WrongDevice(
                f"worker is on GPU {req.device_uuid} but this broker serves GPU {device.index} ({device.uuid})",
                details={"worker_uuid": req.device_uuid, "broker_uuid": device.uuid},
            )
        retried = self.table.by_nonce(req.nonce)
        if retried is not None and _same_process(retried, peer):
            restored = self.ledger.sessions[retried.session_id].restored
            if not restored or retried.token != req.resume:
                # A repeat: the same answer again.  Restored from the state, the session this
                # hello opened before a restart is taken up as it stands (its worker never
                # learnt its token); one it resumed is resumed again below, claims and all.
                if restored:
                    self.ledger.resume(retried.session_id, now, holdings=None)
                retried.routing_id = rid
                return proto.ok_reply(req.id, self._result(retried, version, resumed=retried.resumed))
        if req.resume is not None:
            binding = self.table.by_token(req.resume)
            if binding is None and req.resume in self.table.fenced:
                raise SessionEvicted(f"session {self.table.fenced[req.resume]} was evicted by an operator")
            if binding is not None:
                return self._resume(req, binding, rid, peer, now, version)
        return self._open(req, rid, peer, now, version)

    def _resume(self, req: proto.Hello, binding: Binding, rid: bytes, peer: Peer, now: float, version: int) -> bytes:
        if not _same_process(binding, peer):
            raise NotOwner(f"session {binding.session_id} belongs to another process; a token alone is not enough")
        binding.routing_id = rid
        binding.version = version
        binding.resumed = True
        self.table.rekey_nonce(binding, req.nonce)
        self.journal.rewrite(binding.session_id)  # its nonce changed: journal the whole record
        claim = None
        if req.holdings is not None:
            h = req.holdings
            claim = Claim(dict(h.pools), h.granted_pages, h.reserve_pages, dict(h.holds), h.mapped_pages)
        restored = self.ledger.sessions[binding.session_id].restored
        session, adopted = self.ledger.resume(binding.session_id, now, holdings=claim)
        if adopted:
            # The worker's books already show these requests (releases it booked before
            # sending); answer their retries from the cache instead of applying them again.
            result = results.ReleaseResult(granted_pages=session.granted_pages, settled=True)
            for request_id in req.settled:
                binding.remember_reply(request_id, None, proto.ok_reply(request_id, result), self.table.reply_cache)
        elif restored and claim is not None:
            log.warning(
                "event=resume_claims_refused session=%s instance=%s detail=growth_does_not_fit_kept_checkpoint",
                session.id, session.instance,
            )
        log.info(
            "event=session_resumed session=%s instance=%s pid=%d restored=%s adopted=%s reserved=%d granted_pages=%d",
            session.id, session.instance, session.pid, restored, adopted, session.reserved_bytes, session.granted_pages,
        )
        return proto.ok_reply(req.id, self._result(binding, version, resumed=True))

    def _check_quotas(self, peer: Peer, now: float) -> None:
        quotas = self.quotas
        rate_key = peer.pid if peer.pid_known else (peer.uid, peer.address)
        if not self._hellos.allow(rate_key, now):
            raise RateLimited("too many hellos from this peer; retry shortly")
        if len(self.table) >= quotas.max_sessions:
            raise RateLimited(f"the broker already serves {quotas.max_sessions} sessions")
        if peer.pid and self.table.count_for_pid(peer.pid) >= quotas.max_sessions_per_pid:
            raise RateLimited(f"pid {peer.pid} already has {quotas.max_sessions_per_pid} sessions")
        if peer.uid is not None and self.table.count_for_uid(peer.uid) >= quotas.max_sessions_per_uid:
            raise RateLimited(f"uid {peer.uid} already has {quotas.max_sessions_per_uid} sessions")

    def _open(self, req: proto.Hello, rid: bytes, peer: Peer, now: float, version: int) -> bytes:
        if req.tp_rank >= req.tp_size:
            raise BadRequest(f"tp_rank {req.tp_rank} must be below tp_size {req.tp_size}")
        self._check_quotas(peer, now)
        if req.page_bytes > self.ledger.total_bytes:
            raise BadRequest(f"page_bytes {req.page_bytes} is larger than the device ({self.ledger.total_bytes} bytes)")
        claimed_bytes = _claimed_bytes(req.holdings, req.page_bytes)
        if claimed_bytes:
            # Claims are a resume's business: a session this broker never knew starts empty,
            # and its worker asks again for what it holds, through admission like anyone.
            log.info("event=hello_claims_ignored instance=%s pid=%d resume=%s", req.instance, req.pid, req.resume is not None)
        session_id = self.table.new_session_id()
        verified = peer.pid_known
        start_ticks = self.lifecycle.processes.start_ticks(req.pid) if verified else None
        holder = holder_of(req.pid, verified, start_ticks, peer.uid)
        self.ledger.open_session(
            session_id, instance=req.instance, pid=req.pid, pid_verified=verified, tp_rank=req.tp_rank,
            tp_size=req.tp_size, page_bytes=req.page_bytes, now_s=now, report_mapping=req.report_mapping,
        )
        binding = Binding(
            session_id=session_id, token=self.tokens.issue(session_id, holder), nonce=req.nonce, pid=req.pid,
            pid_verified=verified, pid_start_ticks=start_ticks, uid=peer.uid, version=version, client=req.client,
            adapter=None if req.adapter is None else msgspec.structs.asdict(req.adapter), routing_id=rid,
        )
        self.table.add(binding)
        if self.ledger.growth_hold is not None:
            self._spent_ids.add(session_id)
            if req.resume is not None and claimed_bytes:
                self._allow_reassertion(req, binding, holder, claimed_bytes)
        self._drop_foreign_hello_limits(req.instance, peer.uid)
        hello_limits = None if req.limits is None else self._limits_from_hello(req.instance, req.limits, peer.uid)
        log.info(
            "event=session_open session=%s instance=%s pid=%d uid=%s verified=%s rank=%d tp_size=%d page_bytes=%d",
            session_id, req.instance, req.pid, peer.uid, verified, req.tp_rank, req.tp_size, req.page_bytes,
        )
        result = self._result(binding, version, resumed=False)
        if hello_limits is not None:
            result.hello_limits = hello_limits
        if verified:
            self.lifecycle.watch(req.pid)  # a process already gone is reclaimed at once
        return proto.ok_reply(req.id, result)

    def spend(self, session_id: str) -> None:
        """``session_id`` was restored from the state: a token of it earns no allowance."""
        self._spent_ids.add(session_id)

    def _allow_reassertion(self, req: proto.Hello, binding: Binding, holder: str, claimed_bytes: int) -> None:
        """A resume hello whose session this broker does not know, while growth is held: an
        allowance to grow back what it claims, if its token proves the session was this
        process's (issued by this secret to it), lost, and not re-asserted already."""
        assert req.resume is not None
        lost_id = self.tokens.verify(req.resume, holder)
        if lost_id is None:
            why = "the_token_was_not_issued_to_this_process_by_this_broker"
        elif lost_id in self._spent_ids:
            why = f"session_{lost_id}_was_issued_by_this_broker_or_reasserted_already"
        elif self._started_after_the_broker(binding):
            why = "the_process_started_after_this_broker_and_cannot_have_held_memory_before_it"
        else:
            self._spent_ids.add(lost_id)
            allowance_bytes = self.ledger.allow_reassertion(binding.session_id, claimed_bytes)
            log.info("event=reassertion_allowed session=%s lost_session=%s instance=%s pid=%d allowance_bytes=%d",
                     binding.session_id, lost_id, req.instance, req.pid, allowance_bytes)
            return
        log.warning("event=reassertion_refused session=%s instance=%s pid=%d claimed_bytes=%d detail=%s",
                    binding.session_id, req.instance, req.pid, claimed_bytes, why)

    def _started_after_the_broker(self, binding: Binding) -> bool:
        started = binding.pid_start_ticks
        return started is not None and self.broker_start_ticks is not None and started > self.broker_start_ticks

    def _drop_foreign_hello_limits(self, instance: str, uid: int | None) -> None:
        """A session of another uid joined an instance whose limits a hello set: they were that
        uid's to ask for its own instance, and the instance is no longer its alone."""
        current = self.ledger.limits.get(instance)
        if current is not None and current.source == "hello" and (uid is None or current.owner_uid != uid):
            self.ledger.forget_limits(instance)
            log.warning("event=hello_limits instance=%s outcome=dropped reason=a_session_of_uid_%s_joined_"
                        "limits_asked_by_uid_%s", instance, uid, current.owner_uid)

    def _owned_by(self, instance: str, uid: int | None) -> bool:
        """Whether every session of ``instance`` (the one just opened included) is ``uid``'s."""
        if uid is None:
            return False
        for session_id in self.ledger.instance_session_ids(instance):
            binding = self.table.by_id(session_id)
            if binding is None or binding.uid != uid:
                return False
        return True

    def _limits_from_hello(self, instance: str, asked: proto.LimitsRequest, uid: int | None) -> results.HelloLimits:
        """A worker's requested limits, under admin policy: they apply only to an instance no
        admin or config has set limits for (``ignored``), whose sessions all belong to the
        asker's uid (``forbidden``); a floor is cut to the admin's share of the budget and to
        what the other floors leave, a weight and a priority to the admin's maxima (``clamped``).  Returns
        what became of them, as the hello's answer says it."""
        current = self.ledger.limits.get(instance)
        if current is not None and current.source != "hello":
            return self._limits_outcome(instance, uid, "ignored", f"set by {current.source}")
        if not self._owned_by(instance, uid):
            why = ("the peer's uid is unknown (tcp)" if uid is None
                   else f"instance {instance!r} has sessions of another uid than {uid}")
            return self._limits_outcome(instance, uid, "forbidden", why)
        budget = self.ledger.budget_bytes
        quotas = self.quotas
        cut: list[str] = []
        floor: int | UnsetType = UNSET
        if asked.min_bytes is not proto.UNSET:
            others = sum(lim.min_bytes for name, lim in self.ledger.limits.items() if name != instance)
            bound = min(int(budget * quotas.hello_max_floor_share), budget - others)
            floor = max(0, min(asked.min_bytes, bound))
            if floor < asked.min_bytes:
                cut.append(f"floor cut to {floor} bytes (at most {quotas.hello_max_floor_share:g} of the budget, "
                           "within what the other floors leave)")
        weight: float | UnsetType = UNSET
        if asked.weight is not proto.UNSET:
            weight = min(asked.weight, quotas.hello_max_weight)
            if weight < asked.weight:
                cut.append(f"weight cut to {weight:g} (at most {quotas.hello_max_weight:g})")
        priority: int | UnsetType = UNSET
        if asked.priority is not proto.UNSET:
            priority = min(asked.priority, quotas.hello_max_priority)
            if priority < asked.priority:
                cut.append(f"priority cut to {priority} (at most {quotas.hello_max_priority})")
        try:
            self.ledger.set_limits(
                instance,
                max_bytes=asked.max_bytes,
                min_bytes=floor, weight=weight, source="hello", owner_uid=uid,
                priority=priority,
            )
        except BrokerError as exc:
            return self._limits_outcome(instance, uid, "ignored", exc.message)
        return self._limits_outcome(instance, uid, "clamped" if cut else "applied", "; ".join(cut))

    def _limits_outcome(self, instance: str, uid: int | None, outcome: HelloOutcome,
                        reason: str) -> results.HelloLimits:
        limits = self.ledger.limits.get(instance, Limits())
        log.log(logging.WARNING if outcome == "forbidden" else logging.INFO,
                "event=hello_limits instance=%s uid=%s outcome=%s reason=%r %s", instance, uid, outcome, reason,
                " ".join(f"{key}={value}" for key, value in limits.to_dict().items()))
        return results.HelloLimits(outcome=outcome, reason=reason)

    def _result(self, binding: Binding, version: int, *, resumed: bool) -> results.HelloResult:
        session = self.ledger.sessions[binding.session_id]
        device = self.ledger.device
        return results.HelloResult(
            session=binding.token,
            session_id=binding.session_id,
            version=version,
            lease_s=self.quotas.lease_s,
            heartbeat_s=self.quotas.lease_s / 4,
            resumed=resumed,
            claims=session.resume_claims,
            pid_verified=binding.pid_verified,
            device=results.DeviceInfo(index=device.index, uuid=device.uuid, name=device.name,
                                      simulated=device.simulated),
            limits=self.ledger.limits.get(session.instance, Limits()).view(),
            holdings=proto.Holdings(pools=dict(session.pools), granted_pages=session.granted_pages,
                                    reserve_pages=session.reserve_pages, holds=dict(session.holds),
                                    mapped_pages=session.mapped_pages),
        )


def _claimed_bytes(holdings: proto.Holdings | None, page_bytes: int) -> int:
    """Everything a hello claims its worker holds: pools, holds and pages."""
    if holdings is None:
        return 0
    return sum(holdings.pools.values()) + sum(holdings.holds.values()) + holdings.granted_pages * page_bytes


def _same_process(binding: Binding, peer: Peer) -> bool:
    if binding.pid_verified:
        return peer.pid == binding.pid
    return binding.uid is None or binding.uid == peer.uid
