"""What this GPU's broker can give one instance: the one room calculation both runtimes size by.

The room is read from one status document (docs/design.md, "status --json"), for the
instance by name:

* ``grantable_bytes``: what a reservation made now could grow by.  The broker publishes it
  per instance (``instances[].grantable_bytes``: free memory less the unfilled floors of the
  other instances, within the instance's own ``max_bytes``, 0 when the device is
  overcommitted or growth is held).  A broker too old to publish it: the same figure derived
  from the totals (without the growth hold, which such a broker does not have).
* ``ever_bytes``: the most the broker could *ever* give the instance beyond what it is
  charged now, once the others are down to their floors: ``min(budget - floors of the other
  instances, own max_bytes) - what the instance is charged``.  It bounds a kvcached pool's
  virtual size.

Both count ``replacing_bytes`` as room: the part of the instance's charge that what the
caller sizes now replaces (its own KV sizing hold, its static KV pool).  All sizes are bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..client import BrokerClient
from ..client.units import format_bytes


@dataclass(frozen=True)
class Room:
    endpoint: str
    instance: str
    budget_bytes: int
    free_bytes: int
    #: the most a reservation made now could grow by (what it replaces included)
    grantable_bytes: int
    #: the most the broker could ever give the instance beyond what it is charged now
    ever_bytes: int
    #: instance name -> bytes it is charged, for every other instance on this GPU that is
    others_bytes: dict[str, int] = field(default_factory=dict)

    def describe_others(self) -> str:
        """``name size, ...``, most first; empty when no other instance holds memory."""
        ranked = sorted(self.others_bytes.items(), key=lambda kv: (-kv[1], kv[0]))
        return ", ".join(f"{name} {format_bytes(size)}" for name, size in ranked)


def measure(client: BrokerClient, instance: str, replacing_bytes: int = 0) -> Room:
    """The room for ``instance`` now (one status request)."""
    return from_status(client.status(), instance, client.endpoint, replacing_bytes)


def from_status(status: dict[str, Any], instance: str, endpoint: str, replacing_bytes: int = 0) -> Room:
    """The room for ``instance`` described by one status document.  Reading a document of
    another shape raises ``LookupError``/``TypeError``/``ValueError`` (a broker failure to
    the caller's :func:`~.worker.guard`)."""
    budget_bytes = int(status["budget_bytes"])
    own = next((i for i in status["instances"] if i["name"] == instance), None)
    others = [i for i in status["instances"] if i["name"] != instance]
    if own is not None and "grantable_bytes" in own:
        grantable = int(own["grantable_bytes"])
    else:
        grantable = _derived_grantable(status, own, others)
    ceiling = budget_bytes - sum(int(i.get("min_bytes") or 0) for i in others)
    if own is not None and own.get("max_bytes") is not None:
        ceiling = min(ceiling, int(own["max_bytes"]))
    ever = ceiling - (_charged(own) if own is not None else 0)
    return Room(
        endpoint=endpoint,
        instance=instance,
        budget_bytes=budget_bytes,
        free_bytes=int(status["free_bytes"]),
        grantable_bytes=max(0, grantable) + replacing_bytes,
        ever_bytes=max(0, ever + replacing_bytes),
        others_bytes={i["name"]: _charged(i) for i in others if _charged(i) > 0},
    )


def _charged(instance: dict[str, Any]) -> int:
    if "charged_bytes" in instance:
        return int(instance["charged_bytes"])
    return int(instance["reserved_bytes"]) + int(instance["granted_bytes"]) + int(instance.get("unreported_bytes", 0))


def _derived_grantable(status: dict[str, Any], own: dict[str, Any] | None, others: list[dict[str, Any]]) -> int:
    """``grantable_bytes`` from the totals, for a broker that does not publish it."""
    if status.get("overcommitted"):
        return 0
    floors_bytes = sum(max(0, int(i.get("min_bytes") or 0) - _charged(i)) for i in others)
    grantable = int(status["free_bytes"]) - floors_bytes
    if own is not None and own.get("max_bytes") is not None:
        grantable = min(grantable, int(own["max_bytes"]) - _charged(own))
    return grantable
