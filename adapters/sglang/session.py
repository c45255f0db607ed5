"""This worker's broker session, as an SGLang worker uses it.

``adapters/worker.py`` shares one session per device between every reporter, opened with no
credit reserve (``WorkerIdentity.credit_pages`` is 0): kvcached mode's governors batch their
own grants (``adapters/kvcached``), and a worker's static pools must not compete with idle
credit of its own when its KV sizing asks the broker what it can grant.
"""

from __future__ import annotations

from ...client import BrokerClient
from .. import worker


def client_for(identity: worker.WorkerIdentity) -> BrokerClient | None:
    """The session for ``identity.device`` (None when the worker runs unprotected)."""
    return worker.session(identity)
