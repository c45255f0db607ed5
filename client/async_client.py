"""``AsyncBrokerClient``: the asyncio twin of :class:`BrokerClient` (same methods, as coroutines).

A driver of :class:`~.operations.Operations`, like the sync client, so the two make the same
protocol decisions: each public method runs one operation.  Many requests may be in flight on
one client (replies are matched by id); the books change only between awaits, so concurrent
coroutines see them consistent, and concurrent calls that find the broker restarted share one
resume.  A background task runs :meth:`Operations.background_round` every tick, and at once
when a pressure push arrives: it answers the pushes, tops the credit reserve up, and
heartbeats.  Its public surface is :class:`BrokerClient`'s, with coroutines where that one has
plain methods.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, TypeVar

from . import protocol as proto
from .core import ClientCore, check_pages, package_version, prepare
from .errors import BrokerError
from .operations import BACKGROUND_TICK_S, BackgroundHealth, Invoke, Op, Operations, Resume, Send
from .session_view import SessionView
from .transport import AsyncTransport, CurveKeys, Timeouts
from .trust import endpoint_guard

T = TypeVar("T")

#: What the runtime registers to free pages under pressure (as ``sync_client.PressureCallback``;
#: it may be a coroutine function).
AsyncPressureCallback = Callable[[int], Awaitable[int] | int]


class AsyncBrokerClient(SessionView):
    """A session with one GPU's broker.  Create it with ``await AsyncBrokerClient.connect(...)``."""

    _transport: AsyncTransport

    def __init__(self, core: ClientCore, transport: AsyncTransport):
        self._core = core
        self._ops = Operations(core, endpoint_guard(transport.endpoint, transport.close))
        self._transport = transport
        self._task: asyncio.Task[None] | None = None
        self._resuming: asyncio.Future[None] | None = None
        self._next_heartbeat_s = 0.0
        self._pressure_callback: AsyncPressureCallback | None = None
        self._soft_pressure_callback: AsyncPressureCallback | None = None
        self._pushes: list[proto.Pressure] = []
        self._wake = asyncio.Event()
        self.pressure_log: list[dict[str, int]] = []
        transport.on_push = self._on_push

    @classmethod
    async def connect(
        cls,
        instance: str,
        device: int | str = 0,
        tp_rank: int = 0,
        tp_size: int = 1,
        page_bytes: int = proto.DEFAULT_PAGE_BYTES,
        endpoint: str | None = None,
        credit_pages: int | None = None,
        *,
        timeout_s: float | None = None,
        device_uuid: str | None = None,
        curve: CurveKeys | None = None,
        background: bool = True,
        client: str = "",
        limits: dict[str, Any] | None = None,
        adapter: dict[str, Any] | None = None,
        report_mapping: bool = False,
    ) -> "AsyncBrokerClient":
        """As :meth:`BrokerClient.connect`."""
        core, target = prepare(
            instance, device, tp_rank, tp_size, page_bytes, endpoint, credit_pages,
            device_uuid=device_uuid, limits=limits, adapter=adapter, report_mapping=report_mapping,
            client=client or f"kvcached-broker-async-client/{package_version()}",
        )
        self = cls(core, AsyncTransport(target, Timeouts.from_env(timeout_s), curve=curve))
        try:
            await self._run(self._ops.open(resume=False))
        except BaseException:
            self._transport.close()
            raise
        if background:
            self._task = asyncio.get_running_loop().create_task(self._run_background())
        return self

    # -------------------------------------------------------------- the API
    async def reserve(
        self,
        pools: dict[str, int],
        usage: dict[str, int] | None = None,
        *,
        holds: dict[str, int] | None = None,
        measured_base: bool = False,
        min_holds: dict[str, int] | None = None,
        phase: str | None = None,
    ) -> dict[str, int]:
        """As :meth:`BrokerClient.reserve`."""
        return await self._run(self._ops.reserve(pools, usage, holds, measured_base, min_holds, phase))

    async def acquire(self, pages: int, min_pages: int | None = None, *, wait_s: float | None = None) -> int:
        """As :meth:`BrokerClient.acquire`."""
        return await self._run(self._ops.acquire(pages, min_pages, wait_s))

    async def release(self, pages: int, mapped_pages: int | None = None) -> None:
        """As :meth:`BrokerClient.release`."""
        await self._run(self._ops.release(pages, mapped_pages))

    async def mapped(self, mapped_pages: int) -> int:
        """As :meth:`BrokerClient.mapped`."""
        return await self._run(self._ops.mapped(mapped_pages))

    async def acquire_tp(
        self, pages: int, reduce_min: Callable[[int], Awaitable[int] | int], min_pages: int | None = None
    ) -> int:
        """As :meth:`BrokerClient.acquire_tp`; ``reduce_min`` may be sync or a coroutine."""
        return await self._run(self._ops.acquire_tp(pages, reduce_min, min_pages))

    async def status(self) -> dict[str, Any]:
        """As :meth:`BrokerClient.status`."""
        return await self._run(self._ops.status())

    async def heartbeat(self) -> None:
        """As :meth:`BrokerClient.heartbeat`."""
        await self._run(self._ops.heartbeat())

    def on_pressure(self, callback: AsyncPressureCallback | None, *, soft: AsyncPressureCallback | None = None) -> None:
        """As :meth:`BrokerClient.on_pressure`; the callbacks may be coroutine functions."""
        self._pressure_callback = callback
        self._soft_pressure_callback = soft

    def report_idle(self, pages: int) -> None:
        """As :meth:`BrokerClient.report_idle`."""
        self._core.idle_pages = check_pages("pages", pages, minimum=0)

    async def close(self, timeout_s: float = 2.0) -> None:
        """As :meth:`BrokerClient.close`."""
        if self._core.closed:
            return
        await self._stop_background()
        try:
            await self._run(self._ops.close(timeout_s))
        finally:
            self._transport.close()

    async def __aenter__(self) -> "AsyncBrokerClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # ------------------------------------------------------------ the driver
    async def _run(self, op: Op[T]) -> T:
        """Carry out an operation's actions until it returns (or raises)."""
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
                value = await self._do(action)
            except BaseException as exc:  # noqa: BLE001 - the operation decides: in doubt, refused, ...
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
        assert isinstance(action, Invoke)
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

    # ------------------------------------------------------- the background
    def _heartbeat_due(self) -> bool:
        return time.monotonic() >= self._next_heartbeat_s

    def _on_push(self, push: proto.Pressure) -> None:
        self._pushes.append(push)
        self._wake.set()

    async def _run_background(self) -> None:
        """Every tick (or at once on a push), one background round, until closed or evicted."""
        health = BackgroundHealth(self._core, self._transport.endpoint)
        while not self._core.ended:
            await self._sleep_until_woken(BACKGROUND_TICK_S)
            if self._core.ended:
                return
            pushes, self._pushes = self._pushes, []
            try:
                await self._run(self._ops.background_round(
                    pushes, self._pressure_callback, self._heartbeat_due, self.pressure_log,
                    self._soft_pressure_callback))
                health.ok()
            except BrokerError as exc:
                if health.failed(exc):
                    return

    async def _sleep_until_woken(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=timeout_s)
        except asyncio.TimeoutError:
            pass
        self._wake.clear()

    async def _stop_background(self) -> None:
        """Cancel the background task and wait for it (unless close was called from it)."""
        task, self._task = self._task, None
        if task is None or task is asyncio.current_task():
            return
        task.cancel()
        await asyncio.wait([task])  # a cancellation of close itself still propagates
