"""What workers import to talk to their GPU's kvcached-broker (the client API contract: docs/design.md).

This package never imports torch or the broker: a worker pulls in only pyzmq and msgspec.
The two clients are re-exported lazily (module ``__getattr__``): the broker imports
``client.protocol``, ``client.errors`` and ``client.credit``, and that must not import pyzmq
with the drivers' transport.  The errors (pure Python) are imported eagerly.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    BadRequest,
    BrokerError,
    BrokerUnavailable,
    BudgetExceeded,
    Forbidden,
    LimitExceeded,
    NotOwner,
    Overcommitted,
    RateLimited,
    SessionEvicted,
    StaleRevision,
    UnknownSession,
    UnsupportedVersion,
    UntrustedEndpoint,
    WrongDevice,
)

if TYPE_CHECKING:
    from .async_client import AsyncBrokerClient
    from .sync_client import BrokerClient

#: Name -> the module that defines it, imported on first use.
_LAZY = {"BrokerClient": ".sync_client", "AsyncBrokerClient": ".async_client"}

__all__ = [
    "AsyncBrokerClient",
    "BadRequest",
    "BrokerClient",
    "BrokerError",
    "BrokerUnavailable",
    "BudgetExceeded",
    "Forbidden",
    "LimitExceeded",
    "NotOwner",
    "Overcommitted",
    "RateLimited",
    "SessionEvicted",
    "StaleRevision",
    "UnknownSession",
    "UnsupportedVersion",
    "UntrustedEndpoint",
    "WrongDevice",
]


def __getattr__(name: str) -> Any:
    """Import a lazily re-exported client on first use (and keep it as a module global)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
