"""This worker's room for KV cache on its GPU's broker, and the one clear startup error.

The KV buffer is charged to the worker's session as the ``kv_static`` pool, reported by the
``vllm_kv_cache`` reporter of :mod:`kvcached_broker.adapters.worker` (so other reporters in the
process keep their own pools).  Sizing holds the bytes before vLLM allocates them; the
allocation hook then replaces the hold with what was really allocated.

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
    status = client.status()
    mine, me = _find_session(status, client.session_id)
    own_kv = int(me.get("pools", {}).get(STATIC_POOL, 0)) if me else 0
    own_other = (int(me.get("reserved_bytes", 0)) - own_kv) if me else 0
    grantable = int(status["free_bytes"]) + own_kv
    ceiling = int(status["budget_bytes"]) - own_other
    if mine is not None and mine.get("max_bytes") is not None:
        under_cap = int(mine["max_bytes"]) - int(mine["charged_bytes"]) + own_kv
        grantable, ceiling = min(grantable, under_cap), min(ceiling, int(mine["max_bytes"]) - own_other)
    others = {i["name"]: int(i["charged_bytes"]) for i in status["instances"] if i is not mine and i["charged_bytes"]}
    return Room(client.endpoint, int(status["budget_bytes"]), max(0, grantable), max(0, ceiling), others)


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
    """Reserve ``wanted_bytes`` of KV (at least ``needed_bytes``); returns what is held.

    When the broker refuses the whole ask but has room for at least ``needed_bytes``, that
    room is held instead.  Raises :class:`KVCacheBudgetError` when even that does not fit.
    None when the worker runs (or just turned) unprotected.
    """
    try:
        if worker.report(identity, REPORTER, {STATIC_POOL: wanted_bytes}) is None:
            return None
        return wanted_bytes
    except BudgetExceeded as exc:
        room = int(exc.details.get("free_bytes", 0)) + _held(client)
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


def _held(client: BrokerClient) -> int:
    return int(client.pools.get(STATIC_POOL, 0))
