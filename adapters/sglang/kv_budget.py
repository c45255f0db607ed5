"""The startup error when the broker cannot give this SGLang worker what it needs.

The room itself is the one calculation both runtimes share (:mod:`..room`): the broker's
``grantable_bytes`` for the instance, and what it could ever give it (kvcached mode).  What
SGLang's KV sizing replaces, its own sizing hold, counts as room.
"""

from __future__ import annotations

from ...client import BrokerClient, BudgetExceeded
from ...client.units import format_bytes
from .. import room, worker
from ..room import Room


class BrokerBudgetError(RuntimeError):
    """This worker cannot get the memory it needs to start from its GPU's broker.  One line."""


def measure_room(identity: worker.WorkerIdentity, client: BrokerClient) -> Room:
    """The room for this worker's instance; its own sizing hold, which sizing replaces, counts."""
    return room.measure(client, identity.instance_name(), worker.held_bytes(identity, worker.KV_SIZING_HOLD))


def refusal(found: Room, needed_bytes: int, what: str) -> BrokerBudgetError:
    """The startup error: names the broker, the budget and what the other instances hold."""
    others = found.describe_others()
    return BrokerBudgetError(
        f"kvcached-broker at {found.endpoint} cannot give SGLang instance {found.instance!r} "
        f"{format_bytes(needed_bytes)} for {what}: it can grant {format_bytes(found.grantable_bytes)} "
        f"(budget {format_bytes(found.budget_bytes)}, free {format_bytes(found.free_bytes)}); "
        + (f"other instances hold {others}" if others else "no other instance holds memory")
    )


def explain_refusal(
    identity: worker.WorkerIdentity, client: BrokerClient, needed_bytes: int, what: str, exc: BudgetExceeded
) -> BrokerBudgetError:
    """The startup error for a refused reservation, with the room if the broker still answers."""
    found = worker.guard(identity, "status", lambda: measure_room(identity, client))
    if found is not None:
        return refusal(found, needed_bytes, what)
    return BrokerBudgetError(
        f"kvcached-broker at {client.endpoint} cannot give SGLang instance {identity.instance_name()!r} "
        f"{format_bytes(needed_bytes)} for {what}: {exc}"
    )
