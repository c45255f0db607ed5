"""Every client call as a generator of I/O actions: the one place where protocol decisions live.

A call (``reserve``, ``acquire``, a resume, a pressure answer, ...) is a generator that yields
what it needs done and receives the outcome:

* :class:`Send`: send ``payload`` as request ``request_id`` and wait for its reply (the
  driver's transport resends the same bytes until a reply or its timeout); the driver sends
  back the :class:`~.protocol.Reply`, or throws the transport's exception in;
* :class:`Resume`: re-open the session (the driver runs :meth:`Operations.open`, and shares
  one resume among calls in flight: an asyncio client may have many);
* :class:`Invoke`: call code outside the core (a pressure callback, a tensor-parallel
  ``reduce_min``, the endpoint guard, the driver's heartbeat clock), awaiting its result if
  it is a coroutine.

Everything a call decides is here: its argument checks, whether the credit reserve serves it
without a round trip, what it sends, how it books the answer, when it resumes, and what the
background does in a round.  ``BrokerClient`` (threads) and ``AsyncBrokerClient`` (asyncio)
are drivers: each public method runs one operation, and each driver keeps only what its
concurrency model needs (a lock and a thread; a shared resume and a task).  Nothing here does
I/O or reads a clock.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any, Callable, Final, Generator, TypeVar

from . import protocol as proto
from . import results
from .core import RESUME_CODES, ClientCore, check_ask, check_pages, check_wait
from .errors import BadRequest, BrokerError, BrokerUnavailable, SessionEvicted, UntrustedEndpoint

log = logging.getLogger("kvcached_broker.client")


# The actions are not frozen: one is built per request, and a frozen dataclass's __init__
# costs three times a plain one's (docs/performance.md).  Nothing changes one once yielded.
@dataclass(slots=True)
class Send:
    request_id: int
    payload: bytes
    total_s: float | None = None


@dataclass(slots=True)
class Resume:
    token: str | None  # the token the failed request used: a resume already done since is enough


@dataclass(slots=True)
class Invoke:
    fn: Callable[..., Any]
    args: tuple[Any, ...]


Action = Send | Resume | Invoke
T = TypeVar("T")
#: An operation: a generator of actions, sent what each action gave, returning the call's result.
Op = Generator[Action, Any, T]

def drive(op: Op[T], do: Callable[[Action], Any]) -> T:
    """Carry out ``op``'s actions with ``do`` until it returns (or raises): what each action
    gave, or raised, goes back into the operation, which decides (in doubt, refused, ...).
    The synchronous drivers' loop; the asyncio client awaits ``do`` in the same loop."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            action = op.throw(error) if error is not None else op.send(value)
        except StopIteration as done:
            result: T = done.value  # what ``op`` returned
            return result
        value, error = None, None
        try:
            value = do(action)
        except BaseException as exc:  # noqa: BLE001 - the operation decides
            error = exc


class _Moot(enum.Enum):
    """A sentinel's type, as an enum so that ``result is MOOT`` narrows a result."""

    MOOT = "moot"


#: What an exchange returns for a request that a lost session made moot.
MOOT: Final = _Moot.MOOT
#: How many times one request resumes its session before its ``not_owner`` is raised: each
#: resume is answered (a broker that restarts again and again while a call waits, as the chaos
#: run's restarts in a row make it, is followed), but a broker that keeps answering
#: ``not_owner`` to a session it has just re-bound is not followed for ever.
MAX_RESUMES_PER_REQUEST = 8

#: How often a driver's background wakes to answer pushes, refill the reserve and heartbeat.
BACKGROUND_TICK_S = 0.05
#: The sync client's tick while its session could give pages back when asked: a pressure push
#: waits at most this long for its answer to start.
PUSH_TICK_S = 0.005


class Operations:
    def __init__(self, core: ClientCore, guard: Callable[[bool], None] | None = None):
        self.core = core
        #: ``guard(answered)`` refuses an endpoint that may not be the broker's (``client.trust``).
        self.guard = guard
        self._reasserting = False  # a re-assertion runs now (its own requests must not start another)

    # ------------------------------------------------------------ the calls
    def open(self, *, resume: bool) -> Op[None]:
        """Hello (or resume); a broker that lost the session gets the books asked for again.

        The endpoint is checked before the hello and again once its reply has come, before
        anything in that reply is believed: a refusal closes this client for good.
        """
        core = self.core
        hello = core.hello(resume=resume)
        yield from self._guard(answered=False)
        reply = yield Send(hello.id, proto.encode(hello))
        yield from self._guard(answered=True)
        if not reply.ok:
            raise core.error_of(reply)
        if core.on_hello(results.decode(reply.result, results.HelloResult)):
            yield from self._reassert()

    def _guard(self, *, answered: bool) -> Op[None]:
        if self.guard is None:
            return
        try:
            yield Invoke(self.guard, (answered,))
        except UntrustedEndpoint:
            self.core.closed = True
            raise

    def reserve(self, pools: dict[str, int], usage: dict[str, int] | None, holds: dict[str, int] | None,
                measured_base: bool, min_holds: dict[str, int] | None = None,
                phase: str | None = None) -> Op[dict[str, int]]:
        core = self.core
        build = core.reserve_request(pools, usage, holds, measured_base, min_holds, phase)
        result = yield from self.call(build, results.ReserveResult, track={"on_answer": core.book_pools})
        core.book_pools(result)
        return dict(result.pools)

    def acquire(self, pages: int, min_pages: int | None, wait_s: float | None = None) -> Op[int]:
        """Take ``pages`` (or, with ``min_pages``, the most that fit in between); 0: refused.

        The credit reserve serves it with no round trip when it holds enough and no request
        is in doubt (those are settled first: a late grant may be what serves this one).
        ``wait_s``: if it does not fit now, the broker keeps the ask up to that long and
        answers as soon as it fits (0 only once the time is up).
        """
        check_ask(pages, min_pages)
        wait_s = check_wait(wait_s)
        core = self.core
        core.check_usable()
        if core.outstanding:
            yield from self.settle_in_doubt(None)
        credit = core.credit
        if credit.take(pages):
            return pages
        ask, ask_min = credit.ask(pages, min_pages)
        result = yield from self.call(
            lambda rid: proto.Acquire(
                id=rid, session=core.session_token(), pages=ask, min_pages=ask_min,
                reserve_pages=credit.reserve_pages, caller_pages=pages, caller_min_pages=min_pages,
                wait_s=wait_s, idle_pages=core.idle_to_send(),
            ),
            results.AcquireResult, track={"on_answer": core.book_late_grant},
        )
        core.last_acquire = result
        return credit.settle(pages, min_pages, result.granted)

    def release(self, pages: int, mapped_pages: int | None = None) -> Op[None]:
        """Give back ``pages``: they go to the reserve, and only its surplus above the high
        watermark goes to the broker.  More than held is refused and changes nothing.

        ``mapped_pages`` (a session that reports mapping): how many of the pages it keeps are
        mapped afterwards; it goes with the release, or on its own if nothing goes back."""
        check_pages("pages", pages, minimum=1)
        core = self.core
        core.check_usable()
        if mapped_pages is not None:
            core.check_mapped(mapped_pages, max(0, core.credit.granted_pages - pages))
        surplus = core.put_back(pages)
        if surplus:
            yield from self.return_pages(surplus, mapped_pages)
        elif mapped_pages is not None:
            yield from self.mapped(mapped_pages)

    def mapped(self, mapped_pages: int) -> Op[int]:
        """A session that reports mapping: ``mapped_pages`` of its granted pages are mapped now
        (an absolute count: sending it twice is harmless).  Returns its unmapped pages."""
        core = self.core
        core.check_usable()
        core.check_mapped(mapped_pages, core.credit.granted_pages)
        core.mapped_pages = mapped_pages
        result: results.MappedResult = yield from self.call(
            lambda rid: proto.Mapped(id=rid, session=core.session_token(), mapped_pages=mapped_pages,
                                     reserve_pages=core.credit.reserve_pages, idle_pages=core.idle_to_send()),
            results.MappedResult, track={},
        )
        return result.unmapped_pages

    def return_pages(self, pages: int, mapped_pages: int | None = None) -> Op[None]:
        """Hand ``pages`` (already off the books) back to the broker."""
        core, credit = self.core, self.core.credit
        if mapped_pages is not None:
            core.mapped_pages = mapped_pages
        elif core.report_mapping:  # the pages go from the unmapped ones first, as the broker takes them
            core.mapped_pages = min(core.mapped_pages, credit.granted_pages)
        try:
            yield from self.call(
                lambda rid: proto.Release(id=rid, session=core.session_token(), pages=pages,
                                          reserve_pages=credit.reserve_pages, mapped_pages=mapped_pages,
                                          idle_pages=core.idle_to_send()),
                results.ReleaseResult, track={"booked": True, "on_refusal": lambda: credit.reattach(pages)},
            )
        except BrokerUnavailable:
            raise  # in doubt: stays off the books and is sent again before the next request
        except BrokerError:
            credit.reattach(pages)  # refused: the pages are still this session's
            raise

    def acquire_tp(self, pages: int, reduce_min: Callable[[int], Any], min_pages: int | None) -> Op[int]:
        """Acquire here, agree on the group's minimum with ``reduce_min``, release the surplus.

        ``reduce_min`` is called exactly once on every path (refused arguments, a closed or
        evicted session, a broker that is gone), so a rank that fails still takes part in the
        collective, contributing 0, and the group never deadlocks; the failure is raised after.
        """
        failure: Exception | None = None
        try:
            local = yield from self.acquire(pages, min_pages)
        except Exception as exc:  # noqa: BLE001 - not BaseException: an interrupt or a cancellation stops the rank
            local, failure = 0, exc
        agreed = int((yield Invoke(reduce_min, (local,))))
        if not 0 <= agreed <= local:
            if local:
                yield from self.release(local)
            raise BadRequest(f"reduce_min returned {agreed}, which is not between 0 and this rank's grant of {local}")
        if local > agreed:
            yield from self.release(local - agreed)
        if failure is not None:
            raise failure
        return agreed

    def status(self) -> Op[dict[str, Any]]:
        core = self.core
        status = yield from self.call(
            lambda rid: proto.Status(id=rid, session=core.session_token(), reserve_pages=core.credit.reserve_pages),
            None,
        )
        return results.checked_status(status)

    def heartbeat(self) -> Op[results.HeartbeatResult]:
        core = self.core
        heartbeat: results.HeartbeatResult = yield from self.call(
            lambda rid: proto.Heartbeat(id=rid, session=core.session_token(), reserve_pages=core.credit.reserve_pages,
                                        idle_pages=core.idle_to_send()),
            results.HeartbeatResult, total_s=max(1.0, core.heartbeat_s),
        )
        return heartbeat

    def refill(self) -> Op[None]:
        """Top the credit reserve up once it runs below its low watermark (the background does
        this; not while a caller's own request that changes holdings is in flight)."""
        core, credit = self.core, self.core.credit
        wanted = credit.refill_wanted()
        if wanted and not core.in_flight():
            result = yield from self.call(
                lambda rid: proto.Acquire(id=rid, session=core.session_token(), pages=wanted, min_pages=0,
                                          reserve_pages=credit.reserve_pages, caller_pages=0),
                results.AcquireResult, track={"on_answer": core.book_late_grant},
            )
            credit.reattach(result.granted)

    def background_round(self, pushes: list[proto.Pressure], callback: Callable[[int], Any] | None,
                         heartbeat_due: Callable[[], bool], pressure_log: list[dict[str, int]],
                         soft_callback: Callable[[int], Any] | None = None) -> Op[None]:
        """One round of a driver's background work, in this order: answer the pressure pushes
        that came (each answer appended to ``pressure_log`` as it is made), top the reserve up,
        then heartbeat if ``heartbeat_due()`` (the driver's clock) says so, or if the idle figure
        the runtime reported has not reached the broker yet."""
        for push in pushes:
            pressure_log.append((yield from self.answer_pressure(push, callback, soft_callback)))
        yield from self.refill()
        if self.core.idle_unsent() or (yield Invoke(heartbeat_due, ())):
            yield from self.heartbeat()

    def answer_pressure(self, push: proto.Pressure, callback: Callable[[int], Any] | None,
                        soft_callback: Callable[[int], Any] | None = None) -> Op[dict[str, int]]:
        """The broker asks for pages back: the credit reserve first, then what the runtime frees
        (a soft ask: only what ``soft_callback`` frees of idle memory; none without one)."""
        core = self.core
        from_reserve = core.credit.detach(push.pages)
        if from_reserve:
            yield from self.return_pages(from_reserve)
        from_runtime = 0
        rest = push.pages - from_reserve
        if push.soft:
            callback = soft_callback
        if rest > 0 and callback is not None:
            try:
                from_runtime = max(0, int((yield Invoke(callback, (rest,)))))
            except Exception:
                log.exception("event=pressure_callback_failed session=%s", core.session_id)
        log.info(
            "event=pressure session=%s asked_pages=%d soft=%s returned_reserve=%d returned_runtime=%d",
            core.session_id, push.pages, push.soft, from_reserve, from_runtime,
        )
        return {"asked": push.pages, "from_reserve": from_reserve, "from_runtime": from_runtime}

    def close(self, timeout_s: float) -> Op[None]:
        """Release everything and end the session (nothing to do if evicted or never opened)."""
        core = self.core
        if core.closed:
            return
        try:
            if not core.evicted and core.token is not None:
                yield from self.call(lambda rid: proto.Close(id=rid, session=core.session_token()),
                                     results.CloseResult, total_s=timeout_s, resume=False)
        except BrokerError as exc:
            if exc.code not in ("unknown_session", "evicted", "not_owner"):
                log.warning("event=close_failed session=%s error=%s", core.session_id, exc)
        finally:
            core.closed = True

    # ------------------------------------------------------ request plumbing
    def call(self, build: Callable[[int], Any], shape: type[results.Result] | None, *, total_s: float | None = None,
             resume: bool = True, track: dict[str, Any] | None = None) -> Op[Any]:
        """Send one request and return its result, decoded as ``shape`` (None: as it came); None
        for a booked request the books already show (moot: the broker took them up).

        ``track`` marks a request that changes holdings (see ``core.Outstanding``): it stays
        outstanding until answered, and is sent again before the next request if this call
        gives up on it.  On ``not_owner``/``unknown_session`` (the broker restarted or the
        connection was replaced) the session is resumed and the request sent again.
        """
        core = self.core
        core.check_usable()
        reassert = core.reasserting and not self._reasserting  # one cut short goes on first
        settle = reassert or bool(core.outstanding)
        request_id = core.next_id()
        token_built = core.token
        payload = proto.encode(build(request_id))
        booked = bool(track and track.get("booked"))
        if track is not None:
            # Tracked before the requests in doubt are settled (and a re-assertion cut short
            # goes on): a resume meanwhile must name this one as settled if the books already
            # show it (a release), and a failure leaves it in doubt, never forgotten.
            core.track(request_id, payload, shape=shape, **track)
        try:
            if settle:
                if reassert:
                    yield from self._reassert()
                yield from self.settle_in_doubt(total_s)
                if track is not None and request_id not in core.outstanding:
                    if booked:  # the books the broker took up already show it: moot
                        return None
                    core.track(request_id, payload, shape=shape, **track)  # a lost session dropped it: anew
                if core.token != token_built:  # the session was replaced meanwhile
                    payload = proto.encode(build(request_id))
                    core.retrack(request_id, core.outstanding.get(request_id), payload)
            result = yield from self._exchange(request_id, payload, build, total_s=total_s, resume=resume, booked=booked)
        finally:
            core.gave_up(request_id)  # nothing if it was answered
        if result is MOOT:
            return None
        return result if shape is None else results.decode(result, shape)

    def _exchange(self, request_id: int, payload: bytes, build: Callable[[int], Any] | None, *,
                  total_s: float | None, resume: bool, booked: bool) -> Op[Any]:
        core = self.core
        for _ in range(MAX_RESUMES_PER_REQUEST + 1):
            token_used = core.token
            reply = yield Send(request_id, payload, total_s)
            if reply.ok:
                core.answered(request_id)
                return reply.result
            assert reply.error is not None
            if resume and reply.error.code in RESUME_CODES:
                log.info("event=resume session=%s reason=%s", core.session_id, reply.error.code)
                entry = core.outstanding.get(request_id)
                yield Resume(token_used)
                if core.token != token_used:  # a new session, already given the books' holdings
                    if booked or build is None:
                        return MOOT
                    payload = proto.encode(build(request_id))
                    core.retrack(request_id, entry, payload)
                elif booked and request_id not in core.outstanding:
                    return MOOT  # the books now follow what the broker charges (claims refused)
                continue
            core.answered(request_id)
            raise core.error_of(reply)
        core.answered(request_id)
        raise core.error_of(reply)

    def settle_in_doubt(self, total_s: float | None) -> Op[None]:
        """Send every request a caller gave up on again, before anything else, and book its answer.

        Callers skip it when nothing is outstanding (no generator to build on the hot path)."""
        core = self.core
        for request_id, outstanding in core.in_doubt():
            if core.outstanding.get(request_id) is not outstanding:
                continue  # a lost session dropped it meanwhile
            outstanding.waiting = True
            try:
                result = yield from self._exchange(
                    request_id, outstanding.payload, None, total_s=total_s, resume=True, booked=outstanding.booked
                )
            except BrokerUnavailable:
                outstanding.waiting = False
                raise
            except BrokerError:
                if core.outstanding.get(request_id) is outstanding:  # the resume failed, not this request
                    outstanding.waiting = False
                    raise
                outstanding.on_refusal()
                continue
            if result is not MOOT:
                outstanding.on_answer(result if outstanding.shape is None else results.decode(result, outstanding.shape))
        surplus = core.credit.trim()
        if surplus:
            yield from self.return_pages(surplus)

    def _reassert(self) -> Op[None]:
        """The broker lost this session: ask the new one for what the books say is held (the
        pools and holds, then the held pages, which are uncharged until granted again).

        Each request is tracked as any: one left in doubt is sent again before the next
        request and booked by its late answer, exactly once.  A re-assertion cut short (the
        broker went away again) stays under way: the next call goes on with what is left."""
        core = self.core
        self._reasserting = True
        try:
            wanted = core.reassert_pools
            if wanted is not None:
                pools, holds = wanted
                try:
                    result = yield from self.call(core.reserve_request(pools, None, holds), results.ReserveResult,
                                                  track={"on_answer": core.book_reasserted_pools})
                    core.book_reasserted_pools(result)
                except BrokerUnavailable:
                    raise
                except BrokerError as exc:
                    log.error("event=reassert_refused session=%s what=pools error=%s", core.session_id, exc)
                    core.reassert_pools = None
            # A session that reports mapping asks for its mapped pages as mapped (the device's
            # measurement covers them), then for the rest, which are promised.
            for already_mapped in ((True, False) if core.report_mapping else (False,)):
                ask = core.uncharged_pages
                if already_mapped:
                    ask = min(ask, core.reassert_mapped_pages)
                if not ask or not core.reasserting:
                    continue
                result = yield from self.call(_reasserted_pages(core, ask, already_mapped), results.AcquireResult,
                                              track={"on_answer": _booked_reassertion(core, already_mapped)})
                core.book_reasserted_pages(result.granted, already_mapped)
            if core.reasserting:
                core.reasserted()
        finally:
            self._reasserting = False


def _reasserted_pages(core: ClientCore, pages: int, mapped: bool) -> Callable[[int], proto.Acquire]:
    """The acquire that asks a broker which lost the session for ``pages`` it held (``mapped``:
    pages its caller has mapped, which the device's measurement covers)."""
    def build(rid: int) -> proto.Acquire:
        return proto.Acquire(id=rid, session=core.session_token(), pages=pages, min_pages=0, mapped=mapped)

    return build


def _booked_reassertion(core: ClientCore, mapped: bool) -> Callable[[results.AcquireResult], None]:
    """How the answer to a re-assertion's acquire is booked, late or not: the pages it grants
    are charged again (``ClientCore.book_reasserted_pages``)."""
    def book(result: results.AcquireResult) -> None:
        core.book_reasserted_pages(result.granted, mapped)

    return book


class BackgroundHealth:
    """How a driver's background loop takes the outcome of a round.

    It stops for good once the session is evicted (its memory was given away); a broker that
    does not answer is logged once per outage (the loop goes on, so a restarted broker is
    found by the next heartbeat); any other refusal is logged and the loop goes on.
    """

    def __init__(self, core: ClientCore, endpoint: str):
        self.core = core
        self.endpoint = endpoint
        self.failures = 0

    def ok(self) -> None:
        self.failures = 0

    def failed(self, exc: BrokerError) -> bool:
        """Log a failed round; True when the loop must stop."""
        if isinstance(exc, SessionEvicted):
            log.error("event=evicted session=%s detail=%s", self.core.session_id, exc.message)
            return True
        if isinstance(exc, BrokerUnavailable):
            self.failures += 1
            if self.failures == 1:
                log.warning("event=broker_unreachable endpoint=%s detail=%s", self.endpoint, exc.message)
            return False
        log.warning("event=background_error session=%s error=%s", self.core.session_id, exc)
        return False
