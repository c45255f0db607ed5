"""What a client knows about its session, with no I/O: the sync and asyncio clients both drive it.

It builds requests, reads replies and keeps the client's view of its holdings, which it
re-asserts when it reconnects to a broker that restarted:

* ``pools``: the reservation map the broker last acknowledged;
* ``credit.held_pages`` / ``credit.reserve_pages``: pages handed to the caller / kept in reserve;
* ``uncharged_pages``: held pages the broker does not charge (it lost them and has not, or
  could not, grant them again); the caller's next releases give these back first, without a
  request.  A broker that lost the session charges nothing: every held page is uncharged
  until its re-assertion (``reasserting``) charges it again, the reserve is dropped (nobody
  uses it) and the pools and holds are asked for again (``reassert_pools``);
* ``mapped_pages`` (a session that reports mapping): how many of its granted pages the caller
  last said are mapped; the rest the broker charges as promised memory.

Invariant at every quiet point: ``credit.granted_pages - uncharged_pages`` is what the broker
charges the session in pages, and ``pools``/``holds`` are what it charges in reservations.

**Exactly once.**  Every request that changes holdings stays in ``outstanding`` from the
moment it is built until the broker answers it, whatever happens to the call that sent it
(a timeout, an interrupt).  An outstanding request whose caller gave up is *in doubt*: the
broker may or may not have applied it, so it is sent again, with the same id and the same
bytes, before anything else, and the broker's reply cache makes the repeat harmless; its
late answer is then booked (``Outstanding.on_answer``).  A release is booked before it is
sent (the pages leave the books at once), and tracked before any request in doubt is sent
again; a resume names such requests in ``Hello.settled``, so a restarted broker that adopts
the books answers their repeats without applying them twice.  A hello whose answer never came
is sent again with the same nonce, so a broker that opened a session for it answers with that
session instead of opening a second.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import secrets
from dataclasses import dataclass
from typing import Any, Callable

import msgspec

from . import protocol as proto
from . import results
from .protocol import UNSET
from .credit import CreditReserve, default_credit_pages
from .device import resolve_device
from .endpoint import resolve_endpoint
from .errors import BadRequest, BrokerError, BrokerUnavailable, SessionEvicted, error_from_wire

log = logging.getLogger("kvcached_broker.client")

#: What a reserve's ``phase`` may be (``protocol.Phase``).
_PHASE_RE = re.compile(r"[a-z_]{0,32}")

#: Error codes after which a client re-opens its session with hello(resume) and retries.
RESUME_CODES = frozenset({"not_owner", "unknown_session"})


class _ThisProcess:
    """This process's pid, kept current across ``fork`` so a request needs no ``getpid`` call."""

    pid = os.getpid()

    @classmethod
    def forked(cls) -> None:
        cls.pid = os.getpid()


os.register_at_fork(after_in_child=_ThisProcess.forked)


@dataclass
class Outstanding:
    """A request that changes holdings and has no answer yet."""

    payload: bytes
    #: Its effect is already in the books (a release): a broker that adopts the books on
    #: resume must not apply it again.
    booked: bool
    #: Book a late answer (the caller gave up on it): ``on_answer(result)``, the result decoded
    #: as ``shape`` (the :mod:`.results` struct of the request).
    on_answer: Callable[[Any], None]
    #: The broker refused it: undo what booking it did (put a release's pages back).
    on_refusal: Callable[[], None]
    #: A caller is waiting for it right now (not in doubt).
    waiting: bool = True
    shape: type[results.Result] | None = None


class ClientCore:
    def __init__(
        self,
        *,
        instance: str,
        tp_rank: int,
        tp_size: int,
        page_bytes: int,
        credit_pages: int | None,
        device_uuid: str | None,
        pid: int | None = None,
        client: str = "",
        limits: dict[str, Any] | None = None,
        adapter: dict[str, Any] | None = None,
        report_mapping: bool = False,
    ):
        _check_int("tp_size", tp_size, minimum=1)
        _check_int("tp_rank", tp_rank, minimum=0)
        if tp_rank >= tp_size:
            raise BadRequest(f"tp_rank {tp_rank} must be below tp_size {tp_size}")
        _check_int("page_bytes", page_bytes, minimum=1)
        if credit_pages is not None:
            _check_int("credit_pages", credit_pages, minimum=0)
        if not isinstance(instance, str) or not instance:
            raise BadRequest(f"instance must be a non-empty string, got {instance!r}")
        self.instance = instance
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.page_bytes = page_bytes
        self.device_uuid = device_uuid
        self.pid = os.getpid() if pid is None else pid
        self.client = client
        self.adapter = _adapter_info(adapter)
        self.limits_request = _limits_request(limits)
        self.credit = CreditReserve(default_credit_pages(page_bytes) if credit_pages is None else credit_pages)
        self.uncharged_pages = 0
        self.report_mapping = bool(report_mapping)
        self.mapped_pages = 0
        #: What the runtime says is idle of what it holds (``report_idle``; None: never said),
        #: and the figure last sent (reserve included) with a request.
        self.idle_pages: int | None = None
        self.idle_sent: int | None = None
        #: The broker's answer to the last reserve (None: none answered yet).
        self.last_reserve: results.ReserveResult | None = None
        #: The broker's answer to the last acquire that went to the broker (None: none yet).
        self.last_acquire: results.AcquireResult | None = None
        self.pools: dict[str, int] = {}
        self.holds: dict[str, int] = {}
        self.token: str | None = None
        self.session_id: str | None = None
        self.lease_s = proto.DEFAULT_LEASE_S
        self.heartbeat_s = 2.5
        self.evicted = False
        self.closed = False
        self.outstanding: dict[int, Outstanding] = {}
        #: A broker that lost the session is being asked for what the books hold again: the
        #: pools and holds still to re-reserve (None: none, or done), the held pages still
        #: mapped of those uncharged (a session that reports mapping), and whether it is done.
        self.reasserting = False
        self.reassert_pools: tuple[dict[str, int], dict[str, int]] | None = None
        self.reassert_mapped_pages = 0
        self._hello_nonce: str | None = None  # the last hello's, until it is answered
        self._ids = itertools.count(1)

    # ------------------------------------------------------------- requests
    def next_id(self) -> int:
        return next(self._ids)

    def hello(self, *, resume: bool) -> proto.Hello:
        return proto.Hello(
            id=self.next_id(),
            versions=list(proto.SUPPORTED_VERSIONS),
            instance=self.instance,
            pid=self.pid,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            page_bytes=self.page_bytes,
            nonce=self.hello_nonce(),
            device_uuid=self.device_uuid,
            resume=self.token if resume else None,
            holdings=self.holdings() if resume else None,
            settled=[rid for rid, o in self.outstanding.items() if o.booked] if resume else [],
            limits=self.limits_request,
            client=self.client,
            adapter=self.adapter,
            report_mapping=self.report_mapping,
        )

    def hello_nonce(self) -> str:
        """A fresh nonce, unless the last hello was never answered: then its own (the broker
        answers a repeat with the session that hello opened or resumed, and opens no other)."""
        if self._hello_nonce is None:
            self._hello_nonce = secrets.token_urlsafe(12)
        return self._hello_nonce

    def idle_to_send(self) -> int | None:
        """The ``idle_pages`` a request carries: what the runtime said is idle plus the credit
        reserve, at most what the session holds (None until the runtime said anything)."""
        if self.idle_pages is None:
            return None
        credit = self.credit
        self.idle_sent = min(credit.granted_pages, self.idle_pages + credit.reserve_pages)
        return self.idle_sent

    def idle_unsent(self) -> bool:
        """The idle figure changed since a request last carried it."""
        if self.idle_pages is None:
            return False
        credit = self.credit
        return min(credit.granted_pages, self.idle_pages + credit.reserve_pages) != self.idle_sent

    def holdings(self) -> proto.Holdings:
        return proto.Holdings(
            pools=dict(self.pools),
            granted_pages=self.credit.granted_pages,
            reserve_pages=self.credit.reserve_pages,
            holds=dict(self.holds),
            mapped_pages=min(self.mapped_pages, self.credit.granted_pages) if self.report_mapping else None,
        )

    def on_hello(self, result: results.HelloResult) -> bool:
        """Take a hello's answer; True if it opened a new session where this client had one.

        Then the broker had lost the old session (its state did not survive): nothing
        outstanding can be answered any more, and the books must be asked for again.
        """
        self._hello_nonce = None
        lost = self.token is not None and not result.resumed
        if lost:
            log.warning(
                "event=session_lost old_session=%s new_session=%s detail=reasserting_holdings",
                self.session_id, result.session_id,
            )
            self.outstanding.clear()
            self._lost()
        elif result.claims in ("adopted", "refused"):
            self._follow_restored(result)
        asked = result.hello_limits
        if asked is not UNSET and asked.outcome != "applied":
            log.warning("event=hello_limits instance=%s outcome=%s reason=%r", self.instance, asked.outcome,
                        asked.reason)
        self.token = result.session
        self.session_id = result.session_id
        if result.lease_s is not UNSET:
            self.lease_s = result.lease_s
        self.heartbeat_s = self.lease_s / 4 if result.heartbeat_s is UNSET else result.heartbeat_s
        return lost

    def _follow_restored(self, result: results.HelloResult) -> None:
        """A restored session's resume: the books become what the broker charges now.

        ``adopted``: the broker took the books as they were (held pages it did not charge are
        charged again).  ``refused``: it kept the figures it restored, because the growth
        claimed did not fit.  The pools, holds and reserve then follow those figures; nothing
        the caller holds is taken away (held pages the broker does not charge become
        ``uncharged_pages``); and booked releases are dropped, since the broker's figures
        are now the books' and must not have them subtracted a second time.
        """
        charged = result.holdings
        charged_pages = charged.granted_pages
        if self.report_mapping:
            self.mapped_pages = min(self.mapped_pages, charged.mapped_pages or 0)
        if result.claims == "adopted":
            self.charge_pages(charged_pages)
            return
        claimed_bytes = self._bytes_of(self.pools, self.holds, self.credit.granted_pages)
        for request_id in [rid for rid, o in self.outstanding.items() if o.booked]:
            del self.outstanding[request_id]
        self.book_pools(charged)
        uncharged = self.charge_pages(charged_pages)
        log.error(
            "event=resume_claims_refused session=%s short_bytes=%d uncharged_pages=%d "
            "detail=the_broker_kept_its_restored_figures_and_the_books_follow_them",
            result.session_id, claimed_bytes - self._bytes_of(self.pools, self.holds, charged_pages), uncharged,
        )

    def _lost(self) -> None:
        """The broker lost the session, and charges the new one nothing: so do the books, and
        what the caller holds is to be asked for again (``Operations._reassert``)."""
        if self.pools or self.holds:
            self.reassert_pools = (dict(self.pools), dict(self.holds))
        self.pools, self.holds = {}, {}
        credit = self.credit
        if self.report_mapping:
            self.reassert_mapped_pages = min(self.mapped_pages, credit.held_pages)
        self.mapped_pages = 0
        credit.reserve_pages = 0  # granted by the lost session, used by nobody
        self.uncharged_pages = credit.held_pages
        self.reasserting = True

    def book_reasserted_pools(self, result: results.ReserveResult) -> None:
        """The answer to the reserve that re-asserts the pools (late or not)."""
        self.book_pools(result)
        self.reassert_pools = None

    def book_reasserted_pages(self, granted_pages: int, mapped: bool) -> None:
        """The answer to an acquire that re-asserts held pages (late or not): they are charged
        again, and any beyond what is still uncharged (the caller freed some meanwhile) go to
        the reserve."""
        charged = min(granted_pages, self.uncharged_pages)
        self.uncharged_pages -= charged
        self.credit.reserve_pages += granted_pages - charged
        if mapped:
            self.mapped_pages += granted_pages
            self.reassert_mapped_pages = max(0, self.reassert_mapped_pages - granted_pages)

    def visible_uncharged_pages(self) -> int:
        """``uncharged_pages`` as the caller sees it: none while a re-assertion is still under
        way (they are being asked for again), what it came back short by afterwards."""
        return 0 if self.reasserting else self.uncharged_pages

    def _bytes_of(self, pools: dict[str, int], holds: dict[str, int], pages: int) -> int:
        return sum(pools.values()) + sum(holds.values()) + pages * self.page_bytes

    def charge_pages(self, charged_pages: int) -> int:
        """Book that the broker charges ``charged_pages``: the held pages first, the rest as the
        reserve; returns the held pages it does not charge (``uncharged_pages``)."""
        credit = self.credit
        credit.reserve_pages = max(0, charged_pages - credit.held_pages)
        self.uncharged_pages = max(0, credit.held_pages - charged_pages)
        return self.uncharged_pages

    def put_back(self, pages: int) -> int:
        """The caller frees ``pages``: uncharged ones leave the books alone, the rest go to the
        reserve.  Returns the surplus to send back to the broker (as ``CreditReserve.put_back``)."""
        credit = self.credit
        if pages > credit.held_pages:
            return credit.put_back(pages)  # refused: more than held; nothing changes
        free = min(pages, self.uncharged_pages)
        self.uncharged_pages -= free
        credit.held_pages -= free
        return credit.put_back(pages - free)

    # --------------------------------------------------------- outstanding
    def track(self, request_id: int, payload: bytes, *, booked: bool = False,
              on_answer: Callable[[Any], None] | None = None,
              on_refusal: Callable[[], None] | None = None, shape: type[results.Result] | None = None) -> None:
        """Keep a request that changes holdings until the broker answers it (``shape``: how its
        answer decodes)."""
        self.outstanding[request_id] = Outstanding(
            payload, booked, on_answer or _ignore_answer, on_refusal or _nothing, shape=shape
        )

    def retrack(self, request_id: int, entry: Outstanding | None, payload: bytes) -> None:
        """Track a request again, rebuilt for the new session that replaced a lost one."""
        if entry is not None:
            entry.payload = payload
            self.outstanding[request_id] = entry

    def answered(self, request_id: int) -> Outstanding | None:
        """The broker answered (or definitively refused) ``request_id``."""
        return self.outstanding.pop(request_id, None)

    def gave_up(self, request_id: int) -> None:
        """The caller stopped waiting without an answer: the request is now in doubt."""
        outstanding = self.outstanding.get(request_id)
        if outstanding is not None:
            outstanding.waiting = False

    def in_doubt(self) -> list[tuple[int, Outstanding]]:
        return [(rid, o) for rid, o in self.outstanding.items() if not o.waiting]

    def in_flight(self) -> bool:
        """A caller is waiting right now on a request that changes holdings (an asyncio
        client can have many): the background leaves the reserve to it."""
        return any(o.waiting for o in self.outstanding.values())

    def book_pools(self, result: results.ReserveResult | proto.Holdings) -> None:
        """A reserve's answer (or a resume's holdings): the pools and holds the broker now charges."""
        self.pools = dict(result.pools)
        self.holds = dict(result.holds)
        if isinstance(result, results.ReserveResult):
            self.last_reserve = result

    def check_mapped(self, mapped_pages: Any, granted_pages: int) -> int:
        """A mapped-page count the caller reports: only on a session that reports mapping, and
        at most what it will hold."""
        if not self.report_mapping:
            raise BadRequest("this session does not report mapping: connect with report_mapping=True")
        mapped = check_pages("mapped_pages", mapped_pages, minimum=0)
        if mapped > granted_pages:
            raise BadRequest(f"mapped_pages ({mapped}) must not exceed the {granted_pages} page(s) held")
        return mapped

    def book_late_grant(self, result: results.AcquireResult) -> None:
        """The answer to an acquire whose caller gave up: its pages go to the credit reserve."""
        self.credit.reattach(result.granted)

    def reasserted(self) -> None:
        """The re-assertion is over: what is still uncharged, the broker could not grant."""
        self.reasserting = False
        if self.uncharged_pages > 0:
            log.error(
                "event=uncharged_pages session=%s pages=%d detail=the_broker_lost_this_session_and_cannot_grant_them_again",
                self.session_id, self.uncharged_pages,
            )

    @property
    def ended(self) -> bool:
        """Closed or evicted: no request will be sent any more, in the background or not."""
        return self.closed or self.evicted

    def check_usable(self) -> None:
        if self.evicted:
            raise SessionEvicted(f"session {self.session_id} was evicted; its memory has been given away")
        if self.closed:
            raise BrokerError("this broker client is closed", code="bad_request")
        if _ThisProcess.pid != self.pid:
            raise BrokerError(
                "this broker client belongs to the parent process; create a new client after fork",
                code="not_owner",
            )

    def reserve_request(
        self,
        pools: dict[str, int],
        usage: dict[str, int] | None = None,
        holds: dict[str, int] | None = None,
        measured_base: bool = False,
        min_holds: dict[str, int] | None = None,
        phase: str | None = None,
    ) -> Callable[[int], proto.Reserve]:
        """Check a reserve's arguments now; build its request (for an id) when it is sent."""
        clean, views = check_pools(pools), None if usage is None else check_pools(usage)
        promised = None if holds is None else check_pools(holds)
        least = None if min_holds is None else _check_min_holds(min_holds, promised)
        if phase is not None and (not isinstance(phase, str) or not _PHASE_RE.fullmatch(phase)):
            raise BadRequest(f"phase must be up to 32 lower-case letters and '_', got {phase!r}")
        return lambda rid: proto.Reserve(
            id=rid, session=self.session_token(), pools=clean, usage=views, holds=promised,
            measured_base=bool(measured_base), min_holds=least, phase=phase,
        )

    def session_token(self) -> str:
        assert self.token is not None, "hello first"
        return self.token

    # -------------------------------------------------------------- replies
    def error_of(self, reply: proto.Reply) -> BrokerError:
        assert reply.error is not None
        err = error_from_wire(reply.error.code, reply.error.message, reply.error.details)
        if isinstance(err, SessionEvicted):
            self.evicted = True
        return err


def _ignore_answer(result: Any) -> None:
    return None


def _nothing() -> None:
    return None


def prepare(
    instance: str,
    device: int | str,
    tp_rank: int,
    tp_size: int,
    page_bytes: int,
    endpoint: str | None,
    credit_pages: int | None,
    *,
    device_uuid: str | None,
    limits: dict[str, Any] | None,
    client: str,
    adapter: dict[str, Any] | None = None,
    report_mapping: bool = False,
) -> tuple[ClientCore, str]:
    """What ``connect`` does before any I/O: find the GPU and its broker, check the arguments."""
    physical = resolve_device(device)
    uuid = device_uuid or physical.uuid
    target = resolve_endpoint(physical.index, uuid=uuid, endpoint=endpoint)
    if target is None:
        raise BrokerUnavailable("the broker is switched off (KVCACHED_BROKER=off)")
    core = ClientCore(
        instance=instance,
        tp_rank=tp_rank,
        tp_size=tp_size,
        page_bytes=page_bytes,
        credit_pages=credit_pages,
        device_uuid=uuid,
        limits=limits,
        client=client,
        adapter=adapter,
        report_mapping=report_mapping,
    )
    return core, target


def package_version() -> str:
    """This package's installed version, for the ``client`` a hello names (``0+unknown`` if none)."""
    try:
        from importlib.metadata import version

        return version("kvcached-broker")
    except Exception:  # noqa: BLE001 - not installed as a package: the version is unknown
        return "0+unknown"


def _limits_request(limits: dict[str, Any] | None) -> proto.LimitsRequest | None:
    """``{"max_bytes": .., "min_bytes": .., "weight": .., "priority": ..}`` asked for at hello (admin
    policy may clamp): checked against the wire's bounds (:class:`~.protocol.LimitsRequest`).  A
    key left out is the broker's to decide; ``max_bytes: None`` asks for no cap."""
    if limits is None:
        return None
    unknown = set(limits) - set(proto.LimitsRequest.__struct_fields__)
    if unknown:
        raise BadRequest(f"unknown limit {sorted(unknown)[0]!r}; use {', '.join(proto.LimitsRequest.__struct_fields__)}")
    try:
        return msgspec.convert(limits, proto.LimitsRequest)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"limits: {exc}") from None


def _adapter_info(adapter: dict[str, Any] | None) -> proto.AdapterInfo | None:
    """``{"runtime": .., "runtime_version": .., "patches": [..]}``: the adapter opening the session."""
    if adapter is None:
        return None
    try:
        return msgspec.convert(adapter, proto.AdapterInfo)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"adapter info: {exc}") from None


def _check_min_holds(min_holds: Any, holds: dict[str, int] | None) -> dict[str, int]:
    """``{hold: least bytes}`` for one hold this reserve asks for, at most what it asks."""
    least = check_pools(min_holds)
    if len(least) != 1:
        raise BadRequest(f"min_holds names one hold, got {len(least)}")
    ((name, size),) = least.items()
    if holds is None or name not in holds:
        raise BadRequest(f"min_holds names {name!r}, which holds does not ask for")
    if size > holds[name]:
        raise BadRequest(f"min_holds[{name!r}] ({size}) must not exceed the hold asked ({holds[name]})")
    return least


def check_pages(name: str, value: Any, *, minimum: int) -> int:
    if type(value) is int and minimum <= value <= proto.MAX_PAGES:
        return value  # the common case, in one test
    _check_int(name, value, minimum=minimum)
    pages: int = value  # an int, as _check_int made sure
    if pages > proto.MAX_PAGES:
        raise BadRequest(f"{name} must be at most {proto.MAX_PAGES}, got {pages}")
    return pages


def check_wait(wait_s: Any) -> float | None:
    """``acquire``'s ``wait_s``: None, or seconds above 0 and at most the protocol's bound."""
    if wait_s is None:
        return None
    if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not 0 < wait_s <= proto.MAX_WAIT_S:
        raise BadRequest(f"wait_s must be a number of seconds above 0 and at most {proto.MAX_WAIT_S:g}, got {wait_s!r}")
    return float(wait_s)


def check_ask(pages: Any, min_pages: Any) -> None:
    """An acquire's arguments: ``1 <= pages``, and ``0 <= min_pages <= pages`` unless None."""
    check_pages("pages", pages, minimum=1)
    if min_pages is not None:
        check_pages("min_pages", min_pages, minimum=0)
        if min_pages > pages:
            raise BadRequest(f"min_pages ({min_pages}) must not exceed pages ({pages})")


def check_pools(pools: Any) -> dict[str, int]:
    if not isinstance(pools, dict):
        raise BadRequest(f"reserve() takes a dict of pool name to bytes, got {type(pools).__name__}")
    if len(pools) > proto.MAX_POOLS:
        raise BadRequest(f"at most {proto.MAX_POOLS} pools per session, got {len(pools)}")
    clean = {}
    for name, size in pools.items():
        if not isinstance(name, str) or not name:
            raise BadRequest(f"pool names must be non-empty strings, got {name!r}")
        _check_int(f"pool {name!r}", size, minimum=0)
        clean[name] = int(size)
    return clean


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise BadRequest(f"{name} must be an int >= {minimum}, got {value!r}")
