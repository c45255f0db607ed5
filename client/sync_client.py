"""``BrokerClient``: the synchronous, thread-safe client a worker imports (see README, "Using it from a worker").

A driver of :class:`~.operations.Operations`, which makes every protocol decision: each
public method runs one operation, and this class only turns its actions into socket calls.
One lock serialises use of the socket (and so of the books).  A background thread runs
:meth:`Operations.background_round` every tick: it answers the broker's pressure pushes, tops
the credit reserve up, and heartbeats (so the lease does not lapse while the worker is busy,
and a restarted broker is noticed).  Its public surface is :class:`AsyncBrokerClient`'s, with
plain methods where that one has coroutines.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, TypeVar

from .core import ClientCore, check_pages, package_version, prepare
from .errors import BrokerError
from .protocol import DEFAULT_PAGE_BYTES
from .operations import (
    BACKGROUND_TICK_S,
    PUSH_TICK_S,
    BackgroundHealth,
    Invoke,
    Op,
    Operations,
    Resume,
    Send,
    drive,
)
from .session_view import SessionView
from .transport import CurveKeys, SyncTransport, Timeouts
from .trust import endpoint_guard

T = TypeVar("T")

#: What the runtime registers to free pages under pressure: called with the pages still
#: wanted after the credit reserve, it frees what it can, hands those pages back with
#: ``client.release()`` itself, and returns how many it released.
PressureCallback = Callable[[int], int]


class BrokerClient(SessionView):
    """A session with one GPU's broker.  Create it with :meth:`connect`."""

    _transport: SyncTransport

    def __init__(self, core: ClientCore, transport: SyncTransport):
        self._core = core
        self._ops = Operations(core, endpoint_guard(transport.endpoint, transport.close))
        self._transport = transport
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._pressure_callback: PressureCallback | None = None
        self._soft_pressure_callback: PressureCallback | None = None
        self._next_heartbeat_s = 0.0
        self._thread: threading.Thread | None = None
        self.pressure_log: list[dict[str, int]] = []

    @classmethod
    def connect(
        cls,
        instance: str,
        device: int | str = 0,
        tp_rank: int = 0,
        tp_size: int = 1,
        page_bytes: int = DEFAULT_PAGE_BYTES,
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
    ) -> "BrokerClient":
        """Open a session with the broker of ``device`` (a CUDA ordinal seen by this process).

        ``endpoint=None`` means ``KVCACHED_BROKER`` (or the default ipc path).  Raises
        :class:`BrokerUnavailable` if the broker is off or does not answer.
        """
        core, target = prepare(
            instance, device, tp_rank, tp_size, page_bytes, endpoint, credit_pages,
            device_uuid=device_uuid, limits=limits, adapter=adapter, report_mapping=report_mapping,
            client=client or f"kvcached-broker-client/{package_version()}",
        )
        transport = SyncTransport(target, Timeouts.from_env(timeout_s), curve=curve)
        self = cls(core, transport)
        try:
            self._run(self._ops.open(resume=False))
        except BaseException:
            transport.close()
            raise
        if background:
            self._thread = threading.Thread(target=self._run_background, name=f"kvcached-broker-{instance}", daemon=True)
            self._thread.start()
        return self

    # -------------------------------------------------------------- the API
    def reserve(
        self,
        pools: dict[str, int],
        usage: dict[str, int] | None = None,
        *,
        holds: dict[str, int] | None = None,
        measured_base: bool = False,
        min_holds: dict[str, int] | None = None,
        phase: str | None = None,
    ) -> dict[str, int]:
        """Replace this session's static reservations; a pool at 0 is removed.  Returns them.

        ``usage`` optionally says how those bytes are used, as overlapping named views (shown
        in status as ``usage_breakdown``, never charged).  ``holds`` replaces the session's
        holds (memory promised but not allocated yet, charged on top of what the device
        measures this process using; None keeps them), so a hold turns into the pools it was
        for in one call.  ``min_holds`` (``{hold: least bytes}``, one hold) lets that hold
        shrink to what fits: the broker holds the largest size in between (``holds`` then
        says which).  ``measured_base`` pins what the device measures this process using
        beyond its other reports as the ``runtime_base`` pool.  ``phase`` is where the worker
        is in its start-up, shown in status.  The whole answer (with the instance's
        ``grantable_bytes`` and ``ever_bytes`` after it) is :attr:`last_reserve`.  Raises
        :class:`BudgetExceeded` (naming the pool, the room and who holds it) if the growth
        does not fit.
        """
        with self._lock:
            return self._run(self._ops.reserve(pools, usage, holds, measured_base, min_holds, phase))

    def acquire(self, pages: int, min_pages: int | None = None, *, wait_s: float | None = None) -> int:
        """Take ``pages`` (all or nothing), or with ``min_pages`` the most that fit in between.

        Returns the pages granted; 0 means refused (no room, a cap, or overcommit).  With
        ``wait_s`` (seconds, at most 5) an ask that does not fit waits at the broker, which
        answers it as soon as memory comes back (it asks the others for it at once); 0 only
        once ``wait_s`` has passed.  The call blocks meanwhile.
        """
        with self._lock:
            return self._run(self._ops.acquire(pages, min_pages, wait_s))

    def release(self, pages: int, mapped_pages: int | None = None) -> None:
        """Give back ``pages``; more than held is ``BrokerError(bad_request)``.

        ``mapped_pages``: on a session that reports mapping, how many of the pages it keeps
        are mapped once these are gone (pages it unmapped to give them back)."""
        with self._lock:
            self._run(self._ops.release(pages, mapped_pages))

    def mapped(self, mapped_pages: int) -> int:
        """On a session connected with ``report_mapping=True``: ``mapped_pages`` of the pages it
        holds are mapped now.  The broker charges the others as promised memory, on top of
        what the device measures this process using.  Returns the pages it counts unmapped."""
        with self._lock:
            return self._run(self._ops.mapped(mapped_pages))

    def acquire_tp(self, pages: int, reduce_min: Callable[[int], int], min_pages: int | None = None) -> int:
        """Tensor-parallel acquire: every rank calls this with its own client.

        Each rank asks its own broker, ``reduce_min`` agrees on the minimum over the group
        (e.g. ``torch.distributed`` MIN on the CPU group), and each rank releases its surplus,
        so all ranks return the same count.  ``reduce_min`` is called exactly once per call on
        every rank, even when this rank's broker fails, so the group never deadlocks.
        """
        with self._lock:
            return self._run(self._ops.acquire_tp(pages, reduce_min, min_pages))

    def status(self) -> dict[str, Any]:
        """The broker's status (the same document as ``status --json``)."""
        with self._lock:
            return self._run(self._ops.status())

    def heartbeat(self) -> None:
        """Tell the broker this worker is alive (the background does it on its own)."""
        with self._lock:
            self._run(self._ops.heartbeat())

    def on_pressure(self, callback: PressureCallback | None, *, soft: PressureCallback | None = None) -> None:
        """Register what the runtime can free when the broker asks for pages back.

        ``soft`` answers the broker's soft asks (``pressure.soft``: another instance needs memory,
        and this session is at or below its share): it frees only idle memory (unused cache,
        free pages), never what a running request uses.  Without it a soft ask is answered from
        the credit reserve alone."""
        self._pressure_callback = callback
        self._soft_pressure_callback = soft

    def report_idle(self, pages: int) -> None:
        """Say how many of this session's pages the runtime holds idle (free pages, unused prefix
        cache): the broker asks sessions with idle pages first when another needs memory.  No
        round trip: the figure goes with the next request (the background sends one if none)."""
        self._core.idle_pages = check_pages("pages", pages, minimum=0)

    def close(self, timeout_s: float = 2.0) -> None:
        """Release everything this session holds and end it.  Safe to call twice.

        Waits at most ``timeout_s`` for the broker (a broker that is gone frees the session
        itself when it sees this process exit, or when it restarts without it).
        """
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with self._lock:
            if self._core.closed:
                return
            try:
                self._run(self._ops.close(timeout_s))
            finally:
                self._transport.close()

    def __enter__(self) -> "BrokerClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------ the driver
    def _run(self, op: Op[T]) -> T:
        """Carry out an operation's actions until it returns (or raises)."""
        return drive(op, self._do)

    def _do(self, action: Send | Resume | Invoke) -> Any:
        if type(action) is Send:
            reply = self._transport.request(action.payload, action.request_id, total_s=action.total_s)
            if reply.ok:
                self._next_heartbeat_s = time.monotonic() + self._core.heartbeat_s
            return reply
        if type(action) is Resume:
            if self._core.token == action.token:
                self._run(self._ops.open(resume=True))
            return None
        assert isinstance(action, Invoke)
        return action.fn(*action.args)

    # ------------------------------------------------------- the background
    def _heartbeat_due(self) -> bool:
        return time.monotonic() >= self._next_heartbeat_s

    def _tick_s(self) -> float:
        """How long the background sleeps: briefly while the session could give pages back when
        asked (it holds some, and a runtime callback frees them), so a pressure push is answered
        within a few milliseconds; otherwise the regular tick."""
        core = self._core
        if core.credit.granted_pages and (self._pressure_callback or self._soft_pressure_callback):
            return PUSH_TICK_S
        return BACKGROUND_TICK_S

    def _run_background(self) -> None:
        """Every tick, one background round, skipped while a caller holds the lock."""
        health = BackgroundHealth(self._core, self._transport.endpoint)
        while not self._stop.wait(self._tick_s()):
            if not self._lock.acquire(blocking=False):
                continue
            try:
                if self._core.ended:
                    return
                self._background_step()
                health.ok()
            except BrokerError as exc:
                if health.failed(exc):
                    return
            finally:
                self._lock.release()

    def _background_step(self) -> None:
        self._transport.drain()
        if not (self._transport.pushes or self._heartbeat_due() or self._core.idle_unsent()
                or self._core.credit.refill_wanted()):
            return  # a quick tick with nothing to do
        pushes, self._transport.pushes = self._transport.pushes, []
        self._run(self._ops.background_round(pushes, self._pressure_callback, self._heartbeat_due, self.pressure_log,
                                             self._soft_pressure_callback))

