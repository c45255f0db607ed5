"""``AsyncBrokerClient``: the asyncio twin of :class:`BrokerClient` (same methods, as coroutines).

Many requests may be in flight on one client; replies are matched by id.  The credit reserve
is updated only between awaits, so concurrent coroutines see a consistent reserve.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from . import protocol as proto
from .core import RESUME_CODES, ClientCore, check_pages, prepare
from .errors import BrokerError, BrokerUnavailable, SessionEvicted
from .trust import check_endpoint
from .transport import AsyncTransport, CurveKeys, Timeouts

log = logging.getLogger("kvcached_broker.client")
#: What an exchange returns for a request that a lost session made moot.
_MOOT = object()


class AsyncBrokerClient:
    def __init__(self, core: ClientCore, transport: AsyncTransport):
        self._core = core
        self._transport = transport
        self._heartbeat_task: asyncio.Task | None = None
        self._resuming: asyncio.Future | None = None
        self._settling = asyncio.Lock()
        self._next_heartbeat_s = 0.0
        self._pressure_callback: Callable[[int], Awaitable[int] | int] | None = None
        self.pressure_log: list[dict[str, int]] = []
        transport.on_push = self._on_push

    @classmethod
    async def connect(
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
        client: str = "",
        limits: dict | None = None,
        adapter: dict | None = None,
    ) -> "AsyncBrokerClient":
        core, target = prepare(
            instance, device, tp_rank, tp_size, page_bytes, endpoint, credit_pages,
            device_uuid=device_uuid, limits=limits, adapter=adapter, client=client or "kvcached-broker-async-client",
        )
        self = cls(core, AsyncTransport(target, Timeouts.from_env(timeout_s), curve=curve))
        try:
            await self._open(resume=False)
        except BaseException:
            self._transport.close()
            raise
        self._heartbeat_task = asyncio.get_running_loop().create_task(self._heartbeat_loop())
        return self

    @property
    def session_id(self) -> str | None:
        return self._core.session_id

    @property
    def page_bytes(self) -> int:
        return self._core.page_bytes

    @property
    def held_pages(self) -> int:
        return self._core.credit.held_pages

    @property
    def reserve_pages(self) -> int:
        return self._core.credit.reserve_pages

    async def reserve(
        self,
        pools: dict[str, int],
        usage: dict[str, int] | None = None,
        *,
        holds: dict[str, int] | None = None,
        measured_base: bool = False,
    ) -> dict[str, int]:
        """As :meth:`BrokerClient.reserve`."""
        result = await self._call(
            self._core.reserve_request(pools, usage, holds, measured_base), track={"on_answer": self._core.book_pools}
        )
        self._core.book_pools(result)
        return dict(result["pools"])

    async def acquire(self, pages: int, min_pages: int | None = None) -> int:
        check_pages("pages", pages, minimum=1)
        if min_pages is not None:
            check_pages("min_pages", min_pages, minimum=0)
            if min_pages > pages:
                raise BrokerError(f"min_pages ({min_pages}) must not exceed pages ({pages})", code="bad_request")
        self._core.check_usable()
        await self._settle_in_doubt(None)  # a late grant may serve this from the reserve
        credit = self._core.credit
        if credit.take(pages):
            return pages
        ask, ask_min = credit.ask(pages, min_pages)
        result = await self._call(
            lambda rid: proto.Acquire(
                id=rid, session=self._core.session_token(), pages=ask, min_pages=ask_min, reserve_pages=credit.reserve_pages,
                caller_pages=pages, caller_min_pages=min_pages,
            ),
            track={"on_answer": self._core.book_late_grant},
        )
        return credit.settle(pages, min_pages, int(result["granted"]))

    async def release(self, pages: int) -> None:
        check_pages("pages", pages, minimum=1)
        self._core.check_usable()
        credit = self._core.credit
        surplus = credit.put_back(pages)
        if surplus:
            await self._return_pages(surplus)

    async def acquire_tp(
        self, pages: int, reduce_min: Callable[[int], Awaitable[int] | int], min_pages: int | None = None
    ) -> int:
        """As :meth:`BrokerClient.acquire_tp`; ``reduce_min`` may be sync or a coroutine."""
        failure: BrokerError | None = None
        try:
            local = await self.acquire(pages, min_pages)
        except BrokerError as exc:
            local, failure = 0, exc
        agreed = reduce_min(local)
        if asyncio.iscoroutine(agreed) or isinstance(agreed, asyncio.Future):
            agreed = await agreed
        agreed = int(agreed)
        if not 0 <= agreed <= local:
            if local:
                await self.release(local)
            raise BrokerError(f"reduce_min returned {agreed}, outside 0..{local}", code="bad_request")
        if local > agreed:
            await self.release(local - agreed)
        if failure is not None:
            raise failure
        return agreed

    async def status(self) -> dict[str, Any]:
        self._core.check_usable()
        return await self._call(
            lambda rid: proto.Status(id=rid, session=self._core.session_token(), reserve_pages=self._core.credit.reserve_pages)
        )

    async def close(self, timeout_s: float = 2.0) -> None:
        """As :meth:`BrokerClient.close`."""
        core = self._core
        if core.closed:
            return
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        try:
            if not core.evicted and core.token is not None:
                await self._call(lambda rid: proto.Close(id=rid, session=core.session_token()), total_s=timeout_s, resume=False)
        except BrokerError as exc:
            if exc.code not in ("unknown_session", "evicted", "not_owner"):
                log.warning("event=close_failed session=%s error=%s", core.session_id, exc)
        finally:
            core.closed = True
            self._transport.close()

    async def __aenter__(self) -> "AsyncBrokerClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # ------------------------------------------------------------ internals
    async def _open(self, *, resume: bool) -> None:
        check_endpoint(self._transport.endpoint)
        hello = self._core.hello(resume=resume)
        reply = await self._transport.request(proto.encode(hello), hello.id)
        if not reply.ok:
            raise self._core.error_of(reply)
        if self._core.on_hello(reply.result):
            await self._reassert()

    async def _reassert(self) -> None:
        """The broker lost this session: ask the new one for what the books say is held."""
        core = self._core
        pools, holds, pages = core.reassertion()
        got_pools = None
        if pools or holds:
            try:
                got_pools = await self._call(core.reserve_request(pools, None, holds), track={"on_answer": core.book_pools})
            except BrokerError as exc:
                log.error("event=reassert_refused session=%s what=pools error=%s", core.session_id, exc)
                got_pools = {"pools": {}, "holds": {}}
        granted = 0
        if pages:
            result = await self._call(
                lambda rid: proto.Acquire(id=rid, session=core.session_token(), pages=pages, min_pages=0),
                track={"on_answer": core.book_late_grant},
            )
            granted = int(result["granted"])
        core.book_reasserted(got_pools, granted)

    async def _resume_once(self) -> None:
        """Resume the session; concurrent callers share one hello."""
        if self._resuming is not None:
            await asyncio.shield(self._resuming)
            return
        self._resuming = asyncio.get_running_loop().create_future()
        try:
            await self._open(resume=True)
            self._resuming.set_result(None)
        except BaseException as exc:
            self._resuming.set_exception(exc)
            raise
        finally:
            self._resuming = None

    async def _call(
        self,
        build: Callable[[int], Any],
        *,
        total_s: float | None = None,
        resume: bool = True,
        track: dict[str, Any] | None = None,
    ) -> Any:
        """As :meth:`BrokerClient._call`: ``track`` marks a request that changes holdings."""
        core = self._core
        core.check_usable()
        await self._settle_in_doubt(total_s)
        request_id = core.next_id()
        payload = proto.encode(build(request_id))
        booked = bool(track and track.get("booked"))
        if track is not None:
            core.track(request_id, payload, **track)
        try:
            result = await self._exchange(request_id, payload, build, total_s=total_s, resume=resume, booked=booked)
        finally:
            core.gave_up(request_id)
        return {"settled": True} if result is _MOOT else result

    async def _exchange(
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
            token_used = core.token
            reply = await self._transport.request(payload, request_id, total_s=total_s)
            if reply.ok:
                core.answered(request_id)
                self._next_heartbeat_s = time.monotonic() + core.heartbeat_s
                return reply.result
            assert reply.error is not None
            if resume and reply.error.code in RESUME_CODES:
                entry = core.outstanding.get(request_id)
                if core.token == token_used:
                    await self._resume_once()
                if core.token != token_used:  # a new session, already given the books' holdings
                    if booked or build is None:
                        return _MOOT
                    payload = proto.encode(build(request_id))
                    core.retrack(request_id, entry, payload)
                continue
            core.answered(request_id)
            raise core.error_of(reply)
        core.answered(request_id)
        raise core.error_of(reply)

    async def _settle_in_doubt(self, total_s: float | None) -> None:
        """Send every request a caller gave up on again, before anything else (one coroutine at a time)."""
        if not self._core.outstanding:
            return
        async with self._settling:
            for request_id, outstanding in self._core.in_doubt():
                if self._core.outstanding.get(request_id) is not outstanding:
                    continue  # a lost session dropped it meanwhile
                outstanding.waiting = True
                try:
                    result = await self._exchange(
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
        surplus = self._core.credit.trim()
        if surplus:
            await self._return_pages(surplus)

    async def _return_pages(self, pages: int) -> None:
        """Hand ``pages`` (already off the books) back to the broker."""
        credit = self._core.credit
        try:
            await self._call(
                lambda rid: proto.Release(
                    id=rid, session=self._core.session_token(), pages=pages, reserve_pages=credit.reserve_pages
                ),
                track={"booked": True, "on_refusal": lambda: credit.reattach(pages)},
            )
        except BrokerUnavailable:
            raise  # in doubt: stays off the books and is sent again before the next request
        except BrokerError:
            credit.reattach(pages)
            raise

    async def _heartbeat_loop(self) -> None:
        while not self._core.closed:
            await asyncio.sleep(max(0.05, self._core.heartbeat_s / 2))
            if time.monotonic() < self._next_heartbeat_s:
                continue
            try:
                await self._call(
                    lambda rid: proto.Heartbeat(
                        id=rid, session=self._core.session_token(), reserve_pages=self._core.credit.reserve_pages
                    ),
                    total_s=max(1.0, self._core.heartbeat_s),
                )
            except SessionEvicted:
                log.error("event=evicted session=%s", self._core.session_id)
                return
            except BrokerError as exc:
                log.warning("event=heartbeat_failed session=%s error=%s", self._core.session_id, exc)

    def on_pressure(self, callback: Callable[[int], Awaitable[int] | int] | None) -> None:
        """As :meth:`BrokerClient.on_pressure`; the callback may be a coroutine function."""
        self._pressure_callback = callback

    def _on_push(self, push: proto.Pressure) -> None:
        asyncio.get_running_loop().create_task(self._handle_pressure(push))

    async def _handle_pressure(self, push: proto.Pressure) -> None:
        pages = self._core.credit.detach(push.pages)
        if pages:
            try:
                await self._return_pages(pages)
            except BrokerError as exc:
                log.warning("event=pressure_return_failed session=%s error=%s", self._core.session_id, exc)
        freed = 0
        if push.pages > pages and self._pressure_callback is not None:
            try:
                result = self._pressure_callback(push.pages - pages)
                freed = int(await result) if asyncio.iscoroutine(result) else int(result)
            except Exception:
                log.exception("event=pressure_callback_failed session=%s", self._core.session_id)
        self.pressure_log.append({"asked": push.pages, "from_reserve": pages, "from_runtime": freed})
