"""How a worker sizes its start-up with its GPU's broker: one algorithm for both runtimes.

A serving runtime decides alone how much KV cache to build, and keeps *slack* beside it for
what it allocates after its pools: activations, CUDA graphs, request tables (SGLang keeps
``(1 - mem_fraction_static)`` of the memory it saw before loading weights; vLLM its profiled
activation peak and CUDA graph estimate).  On a shared GPU every byte of both must be admitted
by the broker before it is allocated (docs/accounting.md, "A co-located start-up").
:func:`size` does it in **one** broker request:

* the process's runtime base is pinned (what it uses now: context, weights), so what it
  already uses cannot absorb what it is promised;
* the slack is held in full (``runtime_slack_hold``): the runtime needs it whatever its KV
  cache comes to;
* the KV cache is held at most at the runtime's own figure and at least at what it needs to
  start (``kv_sizing_hold`` with ``min_holds``: the broker holds the largest size in between
  that fits); in kvcached mode (``elastic``) nothing is held for it, since its pages are
  granted as they are mapped, and its virtual size is capped at what the broker could ever
  give the instance (the answer's ``ever_bytes``).

A refusal while other instances hold memory for their own start-ups (servers started together)
is asked again as they settle, for at most ``KVCACHED_BROKER_STARTUP_WAIT_S``.  A refusal raises
:class:`StartupRefused`, whose one-line message names the broker, the ask,
the room and the instances that hold the rest (all from the broker's answer: nothing here
re-derives the ledger's arithmetic or reads the status document).  What happens next is the
runtime's (``adapters/sglang/kv_sizing``, ``adapters/vllm/kv_sizing``): its pools turn the KV
hold into ``kv_static`` (a pool a little larger than the hold takes the difference out of the
slack hold, in the same request), and once its warm-up is over
:meth:`~.device_session.DeviceSession.settle_warm_up` pins the base where the device measures it and keeps the
slack the warm-up did not allocate as the resident pool ``runtime_slack``.

All sizes are bytes.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Mapping

from msgspec import UNSET

from ..client import BudgetExceeded
from ..client.results import ReserveResult
from ..client.units import format_bytes
from . import announce, sessions
from .device_session import DeviceSession
from .report_book import KV_SIZING_HOLD, SLACK_HOLD
from .worker_identity import WorkerIdentity

log = announce.logger("kvcached_broker.adapters")

STARTUP_WAIT_ENV = "KVCACHED_BROKER_STARTUP_WAIT_S"
DEFAULT_STARTUP_WAIT_S = 300.0


@dataclass(frozen=True)
class StartupAsk:
    """What a runtime wants to start with."""

    runtime: str  # "SGLang" or "vLLM", for messages
    kv_bytes: int  # the runtime's own KV figure (a virtual size in kvcached mode)
    kv_min_bytes: int  # the least KV cache it can start with
    slack_bytes: int  # what it keeps beside the KV cache and allocates later
    elastic: bool = False  # kvcached mode: no KV hold; the figure is capped at ``ever_bytes``
    least_reason: str = ""  # why the least is what it is (said in messages)

    def describe(self) -> str:
        slack = f" and {format_bytes(self.slack_bytes)} beside it for activations and CUDA graphs" if self.slack_bytes else ""
        why = f", {self.least_reason}" if self.least_reason else ""
        if self.elastic:
            return f"a KV cache that can grow{slack}"
        if self.kv_min_bytes >= self.kv_bytes:
            return f"a {format_bytes(self.kv_bytes)} KV cache{f' ({self.least_reason})' if why else ''}{slack}"
        least = f" (at least {format_bytes(self.kv_min_bytes)}{why})" if self.kv_min_bytes > 1 << 20 else ""
        return f"a KV cache of up to {format_bytes(self.kv_bytes)}{least}{slack}"


@dataclass(frozen=True)
class Sized:
    """What the broker admitted: ``kv_bytes`` is held (static) or the capped virtual size
    (elastic); ``slack_bytes`` is held."""

    kv_bytes: int
    slack_bytes: int
    grantable_bytes: int  # what the instance could still be granted after this
    ever_bytes: int  # the most the instance could ever be charged beyond its charge now
    holders: tuple[tuple[str, int], ...] = ()  # the other instances charged most, most first

    def describe_holders(self) -> str:
        """``name size, ...``, or that nobody else holds memory."""
        if not self.holders:
            return "no other instance holds memory"
        return "held by " + ", ".join(f"{name} {format_bytes(size)}" for name, size in self.holders)


class StartupRefused(RuntimeError):
    """The broker cannot admit what the runtime needs to start.  One line."""


def size(identity: WorkerIdentity, ask: StartupAsk) -> Sized | None:
    """Admit ``ask`` in one broker request; None when the worker runs (or just turned)
    unprotected.  Raises :class:`StartupRefused` when even its least does not fit, or when the
    broker could never give an elastic KV cache anything."""
    session = sessions.session(identity)
    if session is None:
        return None
    holds = {SLACK_HOLD: max(0, ask.slack_bytes)}
    min_holds = None
    if not ask.elastic and ask.kv_bytes > 0:
        holds[KV_SIZING_HOLD] = ask.kv_bytes
        min_holds = {KV_SIZING_HOLD: max(0, min(ask.kv_min_bytes, ask.kv_bytes))}
    else:
        holds[KV_SIZING_HOLD] = 0
    answer = _hold_waiting_for_start_ups(session, ask, holds, min_holds)
    if answer is None:
        return None
    held, ever_bytes = answer.holds, answer.ever_bytes
    holders = () if answer.holders is UNSET else tuple((h.instance, h.charged_bytes) for h in answer.holders)
    if ask.elastic:
        kv_bytes = max(0, min(ask.kv_bytes, ever_bytes))
        if kv_bytes <= 0 < ask.kv_bytes:
            raise refusal(identity, ask, f"it could never give instance {identity.instance_name()!r} more than "
                                         f"{format_bytes(ever_bytes)} beyond what it holds")
    else:
        kv_bytes = held.get(KV_SIZING_HOLD, 0)
    sized = Sized(kv_bytes, held.get(SLACK_HOLD, 0), answer.grantable_bytes, ever_bytes, holders)
    log.info("event=startup_sized runtime=%s device=%s rank=%d asked_kv=%s kv=%s slack=%s ever=%s elastic=%s",
             ask.runtime, identity.device, identity.tp_rank, format_bytes(ask.kv_bytes), format_bytes(sized.kv_bytes),
             format_bytes(sized.slack_bytes), format_bytes(ever_bytes), ask.elastic)
    return sized


def _hold_waiting_for_start_ups(session: DeviceSession, ask: StartupAsk, holds: dict[str, int],
                                min_holds: dict[str, int] | None) -> ReserveResult | None:
    """:meth:`~.device_session.DeviceSession.hold_what_fits`; refused while other instances hold memory for their own
    start-ups (the refusal's ``starting``), ask again as they settle, for at most
    ``KVCACHED_BROKER_STARTUP_WAIT_S``.  Servers started together are then admitted as if they
    had started one after the other: a neighbour between allocating a pool and reporting it is
    charged for both a moment, and its slack turns into what its warm-up allocated."""
    wait_s = startup_wait_s()
    deadline_s = time.monotonic() + wait_s
    pause_s = 0.05
    told = False
    identity = session.identity
    while True:
        try:
            return session.hold_what_fits(holds, min_holds, phase="sizing")
        except BudgetExceeded as exc:
            starting = _starting(exc)
            left_s = deadline_s - time.monotonic()
            if not starting or left_s <= 0 or exc.code == "limit_exceeded":
                waited = f" (after waiting {wait_s:g} s for start-ups in progress)" if told else ""
                raise refusal(identity, ask, exc.message + waited) from exc
            if not told:
                log.warning("event=startup_waiting device=%s rank=%d for=%s wait_s=%g: %s", identity.device,
                            identity.tp_rank, ",".join(starting), wait_s, exc.message)
                told = True
            time.sleep(min(pause_s, left_s))
            pause_s = min(1.0, pause_s * 2)


def _starting(exc: BudgetExceeded) -> list[str]:
    """The instances a refusal says hold memory for start-ups in progress (none from an older broker)."""
    return [hold.instance for hold in exc.refusal_details.starting]


def startup_wait_s(env: Mapping[str, str] | None = None) -> float:
    """``KVCACHED_BROKER_STARTUP_WAIT_S`` (default 300): how long a refused start-up waits for
    other instances' start-ups in progress; 0 never waits.  Anything but a finite number of
    seconds >= 0 is a one-line :class:`StartupRefused`."""
    raw = (os.environ if env is None else env).get(STARTUP_WAIT_ENV, "").strip()
    if not raw:
        return DEFAULT_STARTUP_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise StartupRefused(f"{STARTUP_WAIT_ENV}={raw[:40]!r} is not a number of seconds >= 0")
    return value


def refusal(identity: WorkerIdentity, ask: StartupAsk, why: str) -> StartupRefused:
    session = sessions.existing(identity)
    endpoint = session.client.endpoint if session is not None else "?"
    return StartupRefused(
        f"kvcached-broker at {endpoint} cannot give {ask.runtime} instance {identity.instance_name()!r} "
        f"(GPU {identity.device}, TP rank {identity.tp_rank}/{identity.tp_size}) {ask.describe()}: {why}"
    )
