"""One error taxonomy for the wire, the client and the adapters.

Every error the broker sends is ``{code, message, details}`` with a stable ``code``.  The
client raises the subclass registered for that code.  Two questions matter to a caller and
each class answers them:

* ``retryable``: the same request may succeed later (no room now, broker restarting).
* ``fatal``: the session can no longer be trusted (it was evicted and its memory given away);
  an adapter must stop serving rather than carry on.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from .results import RefusalDetails

#: Every stable error code, with the one-line meaning documented in the README.
ERROR_CODES = (
    "bad_request",
    "budget_exceeded",
    "limit_exceeded",
    "overcommitted",
    "unknown_session",
    "not_owner",
    "unsupported_version",
    "evicted",
    "forbidden",
    "wrong_device",
    "rate_limited",
    "stale_revision",
    "unavailable",
    "untrusted_endpoint",
    "internal",
)


class BrokerError(Exception):
    """An error reported by the broker, or by the client about the broker."""

    code: str = "internal"  # a class attribute; an instance keeps an unknown code from a newer broker
    retryable: ClassVar[bool] = False
    fatal: ClassVar[bool] = False

    def __init__(self, message: str, *, details: dict[str, Any] | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.details = dict(details or {})
        if code is not None and code != type(self).code:
            self.code = code  # an unknown code from a newer broker keeps its name

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"



class BadRequest(BrokerError):
    """The request was malformed or asked for something impossible (e.g. releasing pages not held)."""

    code = "bad_request"


class BudgetExceeded(BrokerError):
    """No room: granting this would overbook the device budget.  Retry after others release."""

    code = "budget_exceeded"
    retryable = True

    @property
    def refusal_details(self) -> RefusalDetails:
        """:attr:`details`, typed; all defaults where they are not in the shape the protocol
        gives (they only explain the refusal: its code and message are the answer)."""
        try:
            return msgspec.convert(self.details, RefusalDetails)
        except msgspec.ValidationError:
            return RefusalDetails()


class LimitExceeded(BudgetExceeded):
    """An instance limit forbids this: its cap, or a limit change that cannot hold.  Not
    retryable: the same request fails again until the instance frees its own memory or an
    operator changes the limit."""

    code = "limit_exceeded"
    retryable = False


class Overcommitted(BudgetExceeded):
    """Charges already exceed the budget (external usage grew); nothing new is granted."""

    code = "overcommitted"


class UnknownSession(BrokerError):
    """The broker does not know this session token (closed, or a broker that lost its state)."""

    code = "unknown_session"


class NotOwner(BrokerError):
    """The session belongs to another connection or process."""

    code = "not_owner"


class UnsupportedVersion(BrokerError):
    """Client and broker share no protocol version."""

    code = "unsupported_version"


class SessionEvicted(BrokerError):
    """An operator evicted this session; the memory it held has been given to others."""

    code = "evicted"
    fatal = True


class Forbidden(BrokerError):
    """An admin operation from a peer that is not root, the broker's uid or the admin group."""

    code = "forbidden"


class WrongDevice(BrokerError):
    """The worker's GPU is not this broker's GPU: talking to it would overbook silently."""

    code = "wrong_device"


class RateLimited(BrokerError):
    """Too many sessions or hellos from one peer; retry later."""

    code = "rate_limited"
    retryable = True


class StaleRevision(BrokerError):
    """A limit change based on an older revision than the broker holds."""

    code = "stale_revision"


class BrokerUnavailable(BrokerError):
    """The broker did not answer in time, or is switched off (``KVCACHED_BROKER=off``)."""

    code = "unavailable"
    retryable = True


class UntrustedEndpoint(BrokerError):
    """The broker's socket is not where only the broker could have put it (a foreign owner, a
    symlink, a world-writable directory): whatever answers there may be an impostor."""

    code = "untrusted_endpoint"


class InternalError(BrokerError):
    """A bug in the broker; the request was not applied."""

    code = "internal"


_BY_CODE: dict[str, type[BrokerError]] = {
    cls.code: cls
    for cls in (
        BadRequest,
        BudgetExceeded,
        LimitExceeded,
        Overcommitted,
        UnknownSession,
        NotOwner,
        UnsupportedVersion,
        SessionEvicted,
        Forbidden,
        WrongDevice,
        RateLimited,
        StaleRevision,
        BrokerUnavailable,
        UntrustedEndpoint,
        InternalError,
    )
}
assert set(_BY_CODE) == set(ERROR_CODES)


def error_from_wire(code: str, message: str, details: dict[str, Any] | None = None) -> BrokerError:
    """The exception for an error reply; unknown codes become a plain ``BrokerError``."""
    cls = _BY_CODE.get(code, BrokerError)
    return cls(message, details=details, code=code)
