"""This worker's room for KV cache on its GPU's broker, and the one clear startup error.

Sizing *holds* the KV bytes before vLLM allocates them (:mod:`..sizing`): a broker hold named
``kv_sizing_hold``, charged on top of what the device measures the process using, taken
with the process's runtime base pinned in the same request (docs/accounting.md), so the
weights already loaded cannot absorb it.  The allocation hook then turns the hold into the
``kv_static`` pool of the ``vllm_kv_cache`` reporter of the device's session
(:mod:`kvcached_broker.adapters.device_session`) in one broker request (other reporters in the process keep their own pools); a buffer larger
than the hold takes the rest out of the slack hold.

All sizes are bytes.
"""

from __future__ import annotations


from ...client import BrokerClient, BudgetExceeded
from ...client.units import format_bytes
from ..worker_identity import WorkerIdentity
from .. import announce

log = announce.logger("kvcached_broker.adapters.vllm")

REPORTER = "vllm_kv_cache"
STATIC_POOL = "kv_static"


class KVCacheBudgetError(RuntimeError):
    """The broker cannot grant the KV cache this worker needs to start.  One line."""


def explain(identity: WorkerIdentity, client: BrokerClient, asked_bytes: int, what: str,
            exc: BudgetExceeded) -> KVCacheBudgetError:
    """The startup error for a refusal: the broker's own words name the ask, the room and who
    holds the rest."""
    return KVCacheBudgetError(
        f"kvcached-broker at {client.endpoint} cannot grant {what} for vLLM instance {identity.instance_name()!r} "
        f"(GPU {identity.device}, TP rank {identity.tp_rank}/{identity.tp_size}): asked {format_bytes(asked_bytes)}: "
        f"{exc.message}"
    )
