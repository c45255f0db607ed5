"""The startup error when the broker cannot give this SGLang worker what it needs.

Sizing itself is the one algorithm both runtimes share (:mod:`..sizing`); a refusal there or
of a pool's report words the broker's own answer, which names the ask, the room and the
instances that hold the rest.
"""

from __future__ import annotations

from msgspec import UNSET

from ...client import BrokerClient, BudgetExceeded
from ...client.units import format_bytes
from .. import worker_identity


class BrokerBudgetError(RuntimeError):
    """This worker cannot get the memory it needs to start from its GPU's broker.  One line."""


def explain_refusal(
    identity: worker_identity.WorkerIdentity, client: BrokerClient, needed_bytes: int, what: str, exc: BudgetExceeded
) -> BrokerBudgetError:
    """The error for a refused reservation, in the broker's words.  The size said is what the
    charge would have grown by (the broker's ``asked_bytes``): a pool that replaces a hold
    grows by far less than its size."""
    refusal = exc.refusal_details
    if refusal.asked_bytes is not UNSET and refusal.asked_bytes >= 0:
        needed_bytes = refusal.asked_bytes
    more = " more" if refusal.pool_asked_bytes is not UNSET and needed_bytes < refusal.pool_asked_bytes else ""
    return BrokerBudgetError(
        f"kvcached-broker at {client.endpoint} cannot give SGLang instance {identity.instance_name()!r} "
        f"{format_bytes(needed_bytes)}{more} for {what}: {exc.message}"
    )
