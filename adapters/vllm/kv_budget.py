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

from ...client import BrokerClient, BudgetExceeded
from ...client.units import format_bytes
from .. import room, worker
from ..room import Room
from ..worker import WorkerIdentity

log = logging.getLogger("kvcached_broker.adapters.vllm")

REPORTER = "vllm_kv_cache"
STATIC_POOL = "kv_static"


class KVCacheBudgetError(RuntimeError):
    """The broker cannot grant the KV cache this worker needs to start.  One line."""


def measure_room(identity: WorkerIdentity, client: BrokerClient) -> Room:
    """The room for this worker's instance (:mod:`..room`).  This worker's own KV hold and
    ``kv_static`` would be replaced by what it sizes now, so they count as room."""
    return room.measure(client, identity.instance_name(), _own_kv_bytes(identity))


def _own_kv_bytes(identity: WorkerIdentity) -> int:
    """This worker's KV charge that sizing replaces: its sizing hold and its ``kv_static``
    (unless suspended: a sleeping worker's KV cache is not charged)."""
    static = 0 if REPORTER in worker.suspended(identity) else worker.booked_bytes(identity, REPORTER)
    return worker.held_bytes(identity, worker.KV_SIZING_HOLD) + static


def refusal(identity: WorkerIdentity, found: Room, asked_bytes: int, what: str) -> KVCacheBudgetError:
    return KVCacheBudgetError(
        f"kvcached-broker at {found.endpoint} cannot grant {what} for vLLM instance {identity.instance_name()!r} "
        f"(GPU {identity.device}, TP rank {identity.tp_rank}/{identity.tp_size}): asked {format_bytes(asked_bytes)}, "
        f"grantable {format_bytes(found.grantable_bytes)} of a {format_bytes(found.budget_bytes)} budget; "
        f"others hold {found.describe_others() or 'nothing'}"
    )


def hold(identity: WorkerIdentity, client: BrokerClient, wanted_bytes: int, needed_bytes: int) -> int | None:
    """Hold ``wanted_bytes`` of KV (at least ``needed_bytes``); returns what is held.

    The hold replaces any earlier one and pins the runtime base with the first.  When the
    broker refuses the whole ask but has room for at least ``needed_bytes``, that room is
    held instead.  Raises :class:`KVCacheBudgetError` when even that does not fit.  None when
    the worker runs (or just turned) unprotected.
    """
    try:
        if worker.hold(identity, worker.KV_SIZING_HOLD, wanted_bytes) is None:
            return None
        return wanted_bytes
    except BudgetExceeded as exc:
        free_bytes = int(exc.details.get("free_bytes", 0)) + worker.held_bytes(identity, worker.KV_SIZING_HOLD)
        if needed_bytes <= free_bytes < wanted_bytes:
            return hold(identity, client, free_bytes, needed_bytes)
        raise explain(identity, client, wanted_bytes, "the KV cache", exc) from exc


def explain(identity: WorkerIdentity, client: BrokerClient, asked_bytes: int, what: str,
            exc: BudgetExceeded) -> KVCacheBudgetError:
    """The startup error for a refusal, with the room if the broker still answers."""
    found = worker.guard(identity, "status", lambda: measure_room(identity, client))
    if found is not None:
        return refusal(identity, found, asked_bytes, what)
    return KVCacheBudgetError(
        f"kvcached-broker at {client.endpoint} cannot grant {what} for vLLM instance {identity.instance_name()!r} "
        f"(GPU {identity.device}, TP rank {identity.tp_rank}/{identity.tp_size}): asked {format_bytes(asked_bytes)}: {exc}"
    )
