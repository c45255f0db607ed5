"""``BrokerClient``: the synchronous, thread-safe client a worker imports (DESIGN §9).

One lock serialises use of the socket.  A background thread heartbeats (so the lease does
not lapse while the worker is busy), answers the broker's pressure pushes by returning
credit reserve, tops the reserve up, and notices a restarted broker: it re-opens the session
with its token from the same process and re-asserts what it holds.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from . import protocol as proto
from .core import RESUME_CODES, ClientCore, check_pages, prepare
from .errors import BrokerError, BrokerUnavailable, SessionEvicted
from .trust import check_endpoint
from .transport import CurveKeys, SyncTransport, Timeouts

log = logging.getLogger("kvcached_broker.client")

#: What the runtime registers to free pages under pressure: called with the pages still
#: wanted after the credit reserve, it frees what it can, hands those pages back with
#: ``client.release()`` itself, and returns how many it released.
PressureCallback = Callable[[int], int]
#: What an exchange returns for a request that a lost session made moot.
_MOOT = object()


class BrokerClient:
    """A session with one GPU's broker.  Create it with :meth:`connect`."""

    def __init__(self, core: ClientCore, transport: SyncTransport, *, background: bool = True):
        self._core = core
        self._transport = transport
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._pressure_callback: PressureCallback | None = None
        self._next_heartbeat_s = 0.0
        self._thread: threading.Thread | None = None
        self._background = background
        self.pressure_log: list[dict[str, int]] = []

    @classmethod
    def connect(
        cls,
        instance: str,
        device: int | str = 0,
        tp_rank: int = 0,
        tp_size: int = 1,
        page_bytes: int = 2 << 20,
        endpoint: str | None = None,
        credit_pages: int | None = None,
        *,
        timeout_s: float | None = None,
        device_uuid: str | None = None,
        curve: CurveKeys | None = None,
        background: bool = True,
        client: str = "",
        limits: dict | None = None,
        adapter: dict | None = None,
    ) -> "BrokerClient":
        """Open a session with the broker of ``device`` (a CUDA ordinal seen by this process).

        ``endpoint=None`` means ``KVCACHED_BROKER`` (or the default ipc path).  Raises
        :class:`BrokerUnavailable` if the broker is off or does not answer.
        """
        core, target = prepare(
            instance, device, tp_rank, tp_size, page_bytes, endpoint, credit_pages,
            device_uuid=device_uuid, limits=limits, adapter=adapter, client=client or f"kvcached-broker-client/{_version()}",
        )
        transport = SyncTransport(target, Timeouts.from_env(timeout_s), curve=curve)
        self = cls(core, transport, background=background)
        try:
            self._open(resume=False)
        except BaseException:
            transport.close()
            raise
        if background:
            self._thread = threading.Thread(target=self._run_background, name=f"kvcached-broker-{instance}", daemon=True)
            self._thread.start()
        return self

    # ------------------------------------------------------------ properties
    @property
    def session_id(self) -> str | None:
        return self._core.session_id

    @property
    def endpoint(self) -> str:
        return self._transport.endpoint

    @property
    def page_bytes(self) -> int:
        """The size of one page of this session, in bytes."""
        return self._core.page_bytes

    @property
    def held_pages(self) -> int:
        """Pages handed to the caller and not yet released."""
        return self._core.credit.held_pages

    @property
    def reserve_pages(self) -> int:
        return self._core.credit.reserve_pages

    @property
    def pools(self) -> dict[str, int]:
        return dict(self._core.pools)

    @property
    def holds(self) -> dict[str, int]:
        return dict(self._core.holds)

    @property
    def lease_s(self) -> float:
        return self._core.lease_s

    # -------------------------------------------------------------- the API
    def reserve(
        self,
        pools: dict[str, int],
        usage: dict[str, int] | None = None,
        *,
        holds: dict[str, int] | None = None,
        measured_base: bool = False,
    ) -> dict[str, int]:
        """Replace this session's static reservations; a pool at 0 is removed.  Returns them.

        ``usage`` optionally says how those bytes are used, as overlapping named views (shown
        in status as ``usage_breakdown``, never charged).  ``holds`` replaces the session's
        holds (memory promised but not allocated yet, charged on top of what the device
        measures this process using; None keeps them), so a hold turns into the pools it was
        for in one call.  ``measured_base`` pins what the device measures this process using
        beyond its other reports as the ``runtime_base`` pool.  Raises :class:`BudgetExceeded`
        (naming the pool) if the growth does not fit.
        """
        request = self._core.reserve_request(pools, usage, holds, measured_base)
        with self._lock:
            return self._reserve_locked(request)

    def acquire(self, pages: int, min_pages: int | None = None) -> int:
        """Take ``pages`` (all or nothing), or with ``min_pages`` the most that fit in between.

        Returns the pages granted; 0 means refused (no room, a cap, or overcommit).
        """
        check_pages("pages", pages, minimum=1)
        if min_pages is not None:
            check_pages("min_pages", min_pages, minimum=0)
            if min_pages > pages:
                raise BrokerError(f"min_pages ({min_pages}) must not exceed pages ({pages})", code="bad_request")
        with self._lock:
            self._core.check_usable()
            self._settle_in_doubt(None)  # a late grant may serve this from the reserve
            credit = self._core.credit
            if credit.take(pages):
                return pages
            ask, ask_min = credit.ask(pages, min_pages)
            result = self._call(
                lambda rid: proto.Acquire(
                    id=rid,
                    session=self._core.session_token(),
                    pages=ask,
                    min_pages=ask_min,
                    reserve_pages=credit.reserve_pages,
                    caller_pages=pages,
                    caller_min_pages=min_pages,
                ),
                track={"on_answer": self._core.book_late_grant},
            )
            return credit.settle(pages, min_pages, int(result["granted"]))

    def release(self, pages: int) -> None:
        """Give back ``pages``; more than held is ``BrokerError(bad_request)``."""
        check_pages("pages", pages, minimum=1)
        with self._lock:
            self._core.check_usable()
            surplus = self._core.credit.put_back(pages)
            if surplus:
                self._return_pages(surplus)

    def acquire_tp(self, pages: int, reduce_min: Callable[[int], int], min_pages: int | None = None) -> int:
        """Tensor-parallel acquire: every rank calls this with its own client.

        Each rank asks its own broker, ``reduce_min`` agrees on the minimum over the group
        (e.g. ``torch.distributed`` MIN on the CPU group), and each rank releases its surplus,
        so all ranks return the same count.  ``reduce_min`` is called exactly once per call on
        every rank, even when this rank's broker fails, so the group never deadlocks.
        """
        from .tp import tp_acquire

        return tp_acquire(self.acquire, self.release, pages, reduce_min, min_pages)

    def status(self) -> dict[str, Any]:
        """The broker's status (the same document as ``status --json``)."""
        with self._lock:
            self._core.check_usable()
            return self._call(
                lambda rid: proto.Status(
                    id=rid, session=self._core.session_token(), reserve_pages=self._core.credit.reserve_pages
                )
            )

    def heartbeat(self) -> None:
        with self._lock:
            self._heartbeat_locked()

    def on_pressure(self, callback: PressureCallback | None) -> None:
        """Register what the runtime can free when the broker asks for pages back."""
        self._pressure_callback = callback

    def close(self, timeout_s: float = 2.0) -> None:
        """Release everything this session holds and end it.  Safe to call twice.

        Waits at most ``timeout_s`` for the broker (a broker that is gone frees the session
        itself when it sees this process exit, or when it restarts without it).
        """
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with self._lock:
            core = self._core
            if core.closed:
                return
            try:
                if not core.evicted and core.token is not None:
                    self._call(lambda rid: proto.Close(id=rid, session=core.session_token()), total_s=timeout_s, resume=False)
            except BrokerError as exc:
                if exc.code not in ("unknown_session", "evicted", "not_owner"):
                    log.warning("event=close_failed session=%s error=%s", core.session_id, exc)
            finally:
                core.closed = True
                self._transport.close()

    def __enter__(self) -> "BrokerClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------ internals
    def _open(self, *, resume: bool) -> None:
        check_endpoint(self._transport.endpoint)
        hello = self._core.hello(resume=resume)
        reply = self._transport.request(proto.encode(hello), hello.id)
        if not reply.ok:
            raise self._core.error_of(reply)
        lost = self._core.on_hello(reply.result)
        self._next_heartbeat_s = time.monotonic() + self._core.heartbeat_s
        if lost:
            self._reassert()

    def _reassert(self) -> None:
        """The broker lost this session: ask the new one for what the books say is held."""
        pools, holds, pages = self._core.reassertion()
        got_pools = None
        if pools or holds:
            try:
                got_pools = self._call(self._core.reserve_request(pools, None, holds), track={"on_answer": self._core.book_pools})
            except BrokerError as exc:
                log.error("event=reassert_refused session=%s what=pools error=%s", self._core.session_id, exc)
                got_pools = {"pools": {}, "holds": {}}
        granted = 0
        if pages:
            result = self._call(
                lambda rid: proto.Acquire(id=rid, session=self._core.session_token(), pages=pages, min_pages=0),
                track={"on_answer": self._core.book_late_grant},
            )
            granted = int(result["granted"])
        self._core.book_reasserted(got_pools, granted)

    def _reserve_locked(self, request: Callable[[int], proto.Reserve]) -> dict[str, int]:
        result = self._call(request, track={"on_answer": self._core.book_pools})
        self._core.book_pools(result)
        return dict(result["pools"])

    def _call(
        self,
        build: Callable[[int], Any],
        *,
        total_s: float | None = None,
        resume: bool = True,
        track: dict[str, Any] | None = None,
    ) -> Any:
        """Send one request (retried with the same id and bytes) and return its result.

        ``track`` marks a request that changes holdings (see ``core.Outstanding``): it stays
        outstanding until answered, and is sent again before the next request if this call
        gives up on it.  On ``not_owner``/``unknown_session`` (the broker restarted or the
        connection was replaced) the session is resumed and the request sent again.
        """
        core = self._core
        core.check_usable()
        self._settle_in_doubt(total_s)
        request_id = core.next_id()
        payload = proto.encode(build(request_id))
        booked = bool(track and track.get("booked"))
        if track is not None:
            core.track(request_id, payload, **track)
        try:
            result = self._exchange(request_id, payload, build, total_s=total_s, resume=resume, booked=booked)
        finally:
            core.gave_up(request_id)  # nothing if it was answered
        return {"settled": True} if result is _MOOT else result

    def _exchange(
        self,
        request_id: int,
        payload: bytes,
        build: Callable[[int], Any] | None,
        *,
        total_s: float | None,
        resume: bool,
        booked: bool,
    ) -> Any:
        core = self._core
        for _ in range(3):
            reply = self._transport.request(payload, request_id, total_s=total_s)
            if reply.ok:
                core.answered(request_id)
                self._next_heartbeat_s = time.monotonic() + core.heartbeat_s
                return reply.result
            assert reply.error is not None
            if resume and reply.error.code in RESUME_CODES:
                log.info("event=resume session=%s reason=%s", core.session_id, reply.error.code)
                token, entry = core.token, core.outstanding.get(request_id)
                self._open(resume=True)
                if core.token != token:  # a new session, already given the books' holdings
                    if booked or build is None:
                        return _MOOT
                    payload = proto.encode(build(request_id))
                    core.retrack(request_id, entry, payload)
                continue
            core.answered(request_id)
            raise core.error_of(reply)
        core.answered(request_id)
        raise core.error_of(reply)

    def _settle_in_doubt(self, total_s: float | None) -> None:
        """Send every request a caller gave up on again, before anything else, and book its answer."""
        core = self._core
        if not core.outstanding:
            return
        for request_id, outstanding in core.in_doubt():
            if core.outstanding.get(request_id) is not outstanding:
                continue  # a lost session dropped it meanwhile
            outstanding.waiting = True
            try:
                result = self._exchange(
                    request_id, outstanding.payload, None, total_s=total_s, resume=True, booked=outstanding.booked
                )
            except BrokerUnavailable:
                outstanding.waiting = False
                raise
            except BrokerError:
                outstanding.on_refusal()
                continue
            if result is not _MOOT:
                outstanding.on_answer(result)
        surplus = core.credit.trim()
        if surplus:
            self._return_pages(surplus)

    def _return_pages(self, pages: int) -> None:
        """Hand ``pages`` (already off the books) back to the broker."""
        credit = self._core.credit
        try:
            self._call(
                lambda rid: proto.Release(
                    id=rid, session=self._core.session_token(), pages=pages, reserve_pages=credit.reserve_pages
                ),
                track={"booked": True, "on_refusal": lambda: credit.reattach(pages)},
            )
        except BrokerUnavailable:
            raise  # in doubt: stays off the books and is sent again before the next request
        except BrokerError:
            credit.reattach(pages)  # refused: the pages are still this session's
            raise

    def _heartbeat_locked(self) -> None:
        self._call(
            lambda rid: proto.Heartbeat(
                id=rid, session=self._core.session_token(), reserve_pages=self._core.credit.reserve_pages
            ),
            total_s=max(1.0, self._core.heartbeat_s),
        )

    def _run_background(self) -> None:
        failures = 0
        while not self._stop.wait(0.05):
            if not self._lock.acquire(blocking=False):
                continue
            try:
                if self._core.closed or self._core.evicted:
                    return
                self._background_step()
                failures = 0
            except SessionEvicted as exc:
                log.error("event=evicted session=%s detail=%s", self._core.session_id, exc.message)
                return
            except BrokerUnavailable as exc:
                failures += 1
                if failures == 1:
                    log.warning("event=broker_unreachable endpoint=%s detail=%s", self._transport.endpoint, exc.message)
            except BrokerError as exc:
                log.warning("event=background_error session=%s error=%s", self._core.session_id, exc)
            finally:
                self._lock.release()

    def _background_step(self) -> None:
        self._transport.drain()
        pushes, self._transport.pushes = self._transport.pushes, []
        for push in pushes:
            self._handle_pressure(push)
        credit = self._core.credit
        wanted = credit.refill_wanted()
        if wanted:
            result = self._call(
                lambda rid: proto.Acquire(
                    id=rid, session=self._core.session_token(), pages=wanted, min_pages=0,
                    reserve_pages=credit.reserve_pages, caller_pages=0,
                ),
                track={"on_answer": self._core.book_late_grant},
            )
            credit.reattach(int(result["granted"]))
        if time.monotonic() >= self._next_heartbeat_s:
            self._heartbeat_locked()

    def _handle_pressure(self, push: proto.Pressure) -> None:
        credit = self._core.credit
        from_reserve = credit.detach(push.pages)
        if from_reserve:
            self._return_pages(from_reserve)
        freed_by_runtime = 0
        rest = push.pages - from_reserve
        if rest > 0 and self._pressure_callback is not None:
            try:
                freed_by_runtime = max(0, int(self._pressure_callback(rest)))
            except Exception:
                log.exception("event=pressure_callback_failed session=%s", self._core.session_id)
        self.pressure_log.append({"asked": push.pages, "from_reserve": from_reserve, "from_runtime": freed_by_runtime})
        log.info(
            "event=pressure session=%s asked_pages=%d returned_reserve=%d returned_runtime=%d",
            self._core.session_id,
            push.pages,
            from_reserve,
            freed_by_runtime,
        )


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kvcached-broker")
    except Exception:
        return "0+unknown"
