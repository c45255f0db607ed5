"""What the broker can still grant this worker, and the startup error when it is not enough.

The room is read from the broker's status document (docs/design.md, "status --json"):

``grantable_bytes = free_bytes - unfilled floors of the other instances``, further capped by
this instance's own ``max_bytes`` (what it already holds counts against the cap), and 0 when
the device is overcommitted.  That is the most a reservation made now could grow by.

``ever_bytes = min(budget - floors of the other instances, own max_bytes) - what this instance
is charged now``: the most the broker could ever give it on top of what it already uses, once
the others are down to their floors.  That bounds an elastic (kvcached) pool's virtual size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...client import BrokerClient, BudgetExceeded
from ...client.units import format_bytes
from .. import worker


class BrokerBudgetError(RuntimeError):
    """This worker cannot get the memory it needs to start from its GPU's broker.  One line."""


@dataclass(frozen=True)
class BrokerRoom:
    endpoint: str
    instance: str
    budget_bytes: int
    free_bytes: int
    grantable_bytes: int
    #: the most the broker could ever give this instance beyond what it is charged now
    ever_bytes: int = 0
    #: instance name -> bytes it is charged, for every other instance on this GPU
    others_bytes: dict[str, int] = field(default_factory=dict)

    def describe_others(self) -> str:
        if not self.others_bytes:
            return "no other instance holds memory"
        ranked = sorted(self.others_bytes.items(), key=lambda kv: (-kv[1], kv[0]))
        return "other instances hold " + ", ".join(f"{name} {format_bytes(size)}" for name, size in ranked)


def _charged(instance: dict[str, Any]) -> int:
    if "charged_bytes" in instance:
        return int(instance["charged_bytes"])
    return int(instance["reserved_bytes"]) + int(instance["granted_bytes"]) + int(instance.get("unreported_bytes", 0))


def room_from_status(status: dict[str, Any], instance: str, endpoint: str) -> BrokerRoom:
    """The room for ``instance`` described by one status document (the broker's own
    ``grantable_bytes`` for it where the broker gives one)."""
    own = next((i for i in status["instances"] if i["name"] == instance), None)
    others = [i for i in status["instances"] if i["name"] != instance]
    if own is not None and "grantable_bytes" in own:
        grantable = int(own["grantable_bytes"])
    else:
        grantable = _derived_grantable(status, own, others)
    return BrokerRoom(
        endpoint=endpoint,
        instance=instance,
        budget_bytes=int(status["budget_bytes"]),
        free_bytes=int(status["free_bytes"]),
        grantable_bytes=max(0, grantable),
        ever_bytes=max(0, _ever(status, own, others)),
        others_bytes={i["name"]: _charged(i) for i in others if _charged(i) > 0},
    )


def _derived_grantable(status: dict[str, Any], own: dict[str, Any] | None, others: list[dict[str, Any]]) -> int:
    """The same room, from the totals (a broker that does not give ``grantable_bytes``)."""
    if status.get("overcommitted"):
        return 0
    floors_bytes = sum(max(0, int(i.get("min_bytes") or 0) - _charged(i)) for i in others)
    grantable = int(status["free_bytes"]) - floors_bytes
    if own is not None and own.get("max_bytes") is not None:
        grantable = min(grantable, int(own["max_bytes"]) - _charged(own))
    return grantable


def _ever(status: dict[str, Any], own: dict[str, Any] | None, others: list[dict[str, Any]]) -> int:
    floors_bytes = sum(int(i.get("min_bytes") or 0) for i in others)
    ceiling = int(status["budget_bytes"]) - floors_bytes
    if own is not None and own.get("max_bytes") is not None:
        ceiling = min(ceiling, int(own["max_bytes"]))
    return ceiling - (_charged(own) if own is not None else 0)


def measure_room(client: BrokerClient, instance: str) -> BrokerRoom:
    return room_from_status(client.status(), instance, client.endpoint)


def refusal(room: BrokerRoom, needed_bytes: int, what: str) -> BrokerBudgetError:
    """The startup error: names the broker, the budget and what the other instances hold."""
    return BrokerBudgetError(
        f"kvcached-broker at {room.endpoint} cannot give SGLang instance {room.instance!r} "
        f"{format_bytes(needed_bytes)} for {what}: it can grant {format_bytes(room.grantable_bytes)} "
        f"(budget {format_bytes(room.budget_bytes)}, free {format_bytes(room.free_bytes)}); "
        f"{room.describe_others()}"
    )


def explain_refusal(
    identity: worker.WorkerIdentity, client: BrokerClient, needed_bytes: int, what: str, exc: BudgetExceeded
) -> BrokerBudgetError:
    """The startup error for a refused reservation, with the room if the broker still answers."""
    instance = identity.instance_name()
    room = worker.guard(identity, "status", lambda: measure_room(client, instance))
    if room is not None:
        return refusal(room, needed_bytes, what)
    return BrokerBudgetError(
        f"kvcached-broker at {client.endpoint} cannot give SGLang instance {instance!r} "
        f"{format_bytes(needed_bytes)} for {what}: {exc}"
    )
