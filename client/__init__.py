"""What workers import to talk to their GPU's kvcached-broker (the client API contract: docs/design.md).

This package never imports torch or the broker: a worker pulls in only pyzmq and msgspec.
"""

from .async_client import AsyncBrokerClient
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
from .sync_client import BrokerClient

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
