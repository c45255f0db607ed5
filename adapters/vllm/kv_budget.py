"""This worker's room for KV cache on its GPU's broker, and the one clear startup error.

Sizing *holds* the KV bytes before vLLM allocates them: a broker hold named
``kv_sizing_hold``, charged on top of what the device measures the process using, taken
with the process's runtime base pinned in the same request (docs/accounting.md), so the
weights already loaded cannot absorb it.  The allocation hook then turns the hold into the
``kv_static`` pool of the ``vllm_kv_cache`` reporter of :mod:`kvcached_broker.adapters.worker`
in one broker request (other reporters in the process keep their own pools).

All sizes are bytes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ...client import BrokerClient, BudgetExceeded
from ...client.units import format_bytes
from .. import worker
from ..worker import WorkerIdentity

log = logging.getLogger("kvcached_broker.adapters.vllm")

REPORTER = "vllm_kv_cache"
STATIC_POOL = "kv_static"
HOLD = "kv_sizing_hold"


class KVCacheBudgetError(RuntimeError):
    """The broker cannot grant the KV cache this worker needs to start.  One line."""


@dataclass
class Room:
    """What the broker can still give this worker's KV cache, and why (all bytes)."""

    endpoint: str
    budget_bytes: int
    grantable_bytes: int  # free now, plus this worker's own KV hold (it would be replaced)
    ceiling_bytes: int  # the most it could ever get: budget less its other pools, under a cap
    others: dict[str, int] = field(default_factory=dict)  # instance -> charged bytes

    def describe_others(self, limit: int = 4) -> str:
        top = sorted(self.others.items(), key=lambda item: -item[1])[:limit]
        return ", ".join(f"{name} {format_bytes(size)}" for name, size in top) or "nothing"


def measure_room(client: BrokerClient) -> Room:
    """The room from one status document.  This worker's own KV hold and ``kv_static`` would be
    replaced by what it sizes now, so they count as room; what else it uses (its pinned base,
    other pools, or, before it pinned one, what the device measures it using) does not."""
    status = client.status()
    mine, me = _find_session(status, client.session_id)
    own_kv = _own_kv_bytes(me)
    if mine is not None and "grantable_bytes" in mine:  # the broker's room for this instance
        grantable = int(mine["grantable_bytes"]) + own_kv
    else:
        grantable = int(status["free_bytes"]) + own_kv
    ceiling = int(status["budget_bytes"]) - _own_other_bytes(me, own_kv)
    if mine is not None and mine.get("max_bytes") is not None:
        under_cap = int(mine["max_bytes"]) - int(mine["charged_bytes"]) + own_kv
        grantable = min(grantable, under_cap)
        ceiling = min(ceiling, int(mine["max_bytes"]) - _own_other_bytes(me, own_kv))
    others = {i["name"]: int(i["charged_bytes"]) for i in status["instances"] if i is not mine and i["charged_bytes"]}
    return Room(client.endpoint, int(status["budget_bytes"]), max(0, grantable), max(0, ceiling), others)


def _own_kv_bytes(session: dict | None) -> int:
    """This worker's KV charge that sizing replaces: its sizing hold and its ``kv_static``."""
    if session is None:
        return 0
    return int(session.get("holds", {}).get(HOLD, 0)) + int(session.get("pools", {}).get(STATIC_POOL, 0))


def _own_other_bytes(session: dict | None, own_kv: int) -> int:
    """What this worker is charged for besides its KV: its reports, or what it is measured using."""
    if session is None:
        return 0
    reported = int(session.get("reserved_bytes", 0)) + int(session.get("granted_bytes", 0)) - own_kv
    return max(reported, int(session.get("measured_bytes", 0)))


def _find_session(status: dict, session_id: str | None) -> tuple[dict | None, dict | None]:
    for instance in status["instances"]:
        for session in instance["sessions"]:
            if session["id"] == session_id:
                return instance, session
    return None, None


def refusal(identity: WorkerIdentity, room: Room, asked_bytes: int, what: str) -> KVCacheBudgetError:
    return KVCacheBudgetError(
        f"kvcached-broker at {room.endpoint} cannot grant {what} for vLLM instance {identity.instance_name()!r} "
        f"(GPU {identity.device}, TP rank {identity.tp_rank}/{identity.tp_size}): asked {format_bytes(asked_bytes)}, "
        f"grantable {format_bytes(room.grantable_bytes)} of a {format_bytes(room.budget_bytes)} budget; "
        f"others hold {room.describe_others()}"
    )


def hold(identity: WorkerIdentity, client: BrokerClient, wanted_bytes: int, needed_bytes: int) -> int | None:
    """Hold ``wanted_bytes`` of KV (at least ``needed_bytes``); returns what is held.

    The hold replaces any earlier one and pins the runtime base with the first.  When the
    broker refuses the whole ask but has room for at least ``needed_bytes``, that room is
    held instead.  Raises :class:`KVCacheBudgetError` when even that does not fit.  None when
    the worker runs (or just turned) unprotected.
    """
    try:
        if worker.hold(identity, HOLD, wanted_bytes) is None:
            return None
        return wanted_bytes
    except BudgetExceeded as exc:
        room = int(exc.details.get("free_bytes", 0)) + worker.held_bytes(identity, HOLD)
        if needed_bytes <= room < wanted_bytes:
            return hold(identity, client, room, needed_bytes)
        raise explain(identity, client, wanted_bytes, "the KV cache", exc) from exc


def explain(identity: WorkerIdentity, client: BrokerClient, asked_bytes: int, what: str,
            exc: BudgetExceeded) -> KVCacheBudgetError:
    """The startup error for a refusal, with the room if the broker still answers."""
    room = worker.guard(identity, "status", lambda: measure_room(client))
    if room is not None:
        return refusal(identity, room, asked_bytes, what)
    return KVCacheBudgetError(
        f"kvcached-broker at {client.endpoint} cannot grant {what} for vLLM instance {identity.instance_name()!r} "
        f"(GPU {identity.device}, TP rank {identity.tp_rank}/{identity.tp_size}): asked {format_bytes(asked_bytes)}: {exc}"
    )
