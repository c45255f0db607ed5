"""This worker's broker session, opened the way an SGLang worker needs it.

``adapters/worker.py`` shares one session per device between every reporter.  By default a
client keeps a credit reserve of elastic pages (about 64 MiB), refilled in the background
even if the worker never asks for a page; an SGLang worker's static pools would then compete
with its own idle credit, and its KV sizing would see that much less room.  So the adapter
opens its sessions with ``credit_pages=0``: the elastic allocator batches its own grants
(``ElasticBudget``, 16 session pages a step, trimmed with hysteresis) and needs no reserve.

A ``worker.client_factory`` set by a test or an embedder is left as it is.
"""

from __future__ import annotations

from ...client import BrokerClient
from .. import worker


def _connect(identity: worker.WorkerIdentity) -> BrokerClient:
    return BrokerClient.connect(
        identity.instance_name(),
        device=identity.device,
        tp_rank=identity.tp_rank,
        tp_size=identity.tp_size,
        page_bytes=identity.page_bytes,
        credit_pages=0,
        client=f"kvcached-broker-adapter/{identity.runtime}",
    )


def client_for(identity: worker.WorkerIdentity) -> BrokerClient | None:
    """The session for ``identity.device`` (None when the worker runs unprotected)."""
    if worker.client_factory is None:
        worker.client_factory = _connect
    return worker.session(identity)
