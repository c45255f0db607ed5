"""``AsyncBrokerClient``: the asyncio twin of :class:`BrokerClient` (same methods, as coroutines).

A driver of :class:`~.operations.Operations`, like the sync client, so the two make the same
protocol decisions.  Many requests may be in flight on one client (replies are matched by
id); the books change only between awaits, so concurrent coroutines see them consistent,
and concurrent calls that find the broker restarted share one resume.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from . import protocol as proto
from .core import ClientCore, check_pages, prepare
from .errors import BrokerError, SessionEvicted
from .operations import Invoke, Op, Operations, Resume, Send
from .sync_client import _check_ask
from .transport import AsyncTransport, CurveKeys, Timeouts
from .trust import endpoint_guard

log = logging.getLogger("kvcached_broker.client")


class AsyncBrokerClient:
    def __init__(self, core: ClientCore, transport: AsyncTransport):
        self._core = core
        self._ops = Operations(core, endpoint_guard(transport.endpoint, transport.close))
        self._transport = transport
        self._heartbeat_task: asyncio.Task | None = None
        self._resuming: asyncio.Future | None = None
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
            await self._run(self._ops.open(resume=False))
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
        return await self._run(self._ops.reserve(pools, usage, holds, measured_base))

    async def acquire(self, pages: int, min_pages: int | None = None) -> int:
        _check_ask(pages, min_pages)
        core = self._core
        core.check_usable()
        if not core.outstanding and core.credit.take(pages):  # served from the reserve
            return pages
        return await self._run(self._ops.acquire(pages, min_pages))

    async def release(self, pages: int) -> None:
        check_pages("pages", pages, minimum=1)
        self._core.check_usable()
        surplus = self._core.put_back(pages)
        if surplus:
            await self._run(self._ops.return_pages(surplus))

    async def acquire_tp(
        self, pages: int, reduce_min: Callable[[int], Awaitable[int] | int], min_pages: int | None = None
    ) -> int:
        """As :meth:`BrokerClient.acquire_tp`; ``reduce_min`` may be sync or a coroutine."""
        _check_ask(pages, min_pages)  # no check_usable here: an evicted rank must still take part (the op checks)
        return await self._run(self._ops.acquire_tp(pages, reduce_min, min_pages))

    async def status(self) -> dict[str, Any]:
        return await self._run(self._ops.status())

    async def close(self, timeout_s: float = 2.0) -> None:
        """As :meth:`BrokerClient.close`."""
        if self._core.closed:
            return
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        try:
            await self._run(self._ops.close(timeout_s))
        finally:
            self._transport.close()

    async def __aenter__(self) -> "AsyncBrokerClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # ------------------------------------------------------------ the driver
    async def _run(self, op: Op) -> Any:
        """Carry out an operation's actions until it returns (or raises)."""
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                action = op.throw(error) if error is not None else op.send(value)
            except StopIteration as done:
                return done.value
            value, error = None, None
            try:
                value = await self._do(action)
            except BaseException as exc:  # the operation decides: in doubt, refused, ...
                error = exc

    async def _do(self, action: Send | Resume | Invoke) -> Any:
        if type(action) is Send:
            reply = await self._transport.request(action.payload, action.request_id, total_s=action.total_s)
            if reply.ok:
                self._next_heartbeat_s = time.monotonic() + self._core.heartbeat_s
            return reply
        if type(action) is Resume:
            if self._core.token == action.token:
                await self._resume_once()
            return None
        result = action.fn(*action.args)
        if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
            result = await result
        return result

    async def _resume_once(self) -> None:
        """Resume the session; concurrent callers share one hello."""
        if self._resuming is not None:
            await asyncio.shield(self._resuming)
            return
        self._resuming = asyncio.get_running_loop().create_future()
        try:
            await self._run(self._ops.open(resume=True))
            self._resuming.set_result(None)
        except BaseException as exc:
            self._resuming.set_exception(exc)
            raise
        finally:
            self._resuming = None

    async def _heartbeat_loop(self) -> None:
        while not self._core.closed:
            await asyncio.sleep(max(0.05, self._core.heartbeat_s / 2))
            if time.monotonic() < self._next_heartbeat_s:
                continue
            try:
                await self._run(self._ops.heartbeat())
            except SessionEvicted:
                log.error("event=evicted session=%s", self._core.session_id)
                return
            except BrokerError as exc:
                log.warning("event=heartbeat_failed session=%s error=%s", self._core.session_id, exc)

    def on_pressure(self, callback: Callable[[int], Awaitable[int] | int] | None) -> None:
        """As :meth:`BrokerClient.on_pressure`; the callback may be a coroutine function."""
        self._pressure_callback = callback

    def _on_push(self, push: proto.Pressure) -> None:
        asyncio.get_running_loop().create_task(self._answer_pressure(push))

    async def _answer_pressure(self, push: proto.Pressure) -> None:
        try:
            self.pressure_log.append(await self._run(self._ops.answer_pressure(push, self._pressure_callback)))
        except BrokerError as exc:
            log.warning("event=pressure_return_failed session=%s error=%s", self._core.session_id, exc)
