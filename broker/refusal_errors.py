"""A refusal raised: the wire's error for a :class:`.accounts.Refusal`, carrying it.

A reservation the ledger cannot admit is raised (an ``acquire`` answers ``Grant(0, refusal)``
instead).  The error is the one the worker gets (its class gives the wire ``code``); the
request core reads the refusal it carries, typed, rather than the details it will send.
Interpreted: mypyc cannot compile classes that subclass built-in exceptions.
"""

from __future__ import annotations

from ..client.errors import BrokerError, BudgetExceeded, LimitExceeded, Overcommitted
from .accounts import Refusal


class _Carrying(BrokerError):
    refusal: Refusal

    def __init__(self, refusal: Refusal):
        super().__init__(refusal.message, details=refusal.details)
        self.refusal = refusal


class BudgetRefused(_Carrying, BudgetExceeded):
    pass


class OvercommitRefused(_Carrying, Overcommitted):
    pass


class CapRefused(_Carrying, LimitExceeded):
    pass


_BY_CODE: dict[str, type[_Carrying]] = {
    BudgetExceeded.code: BudgetRefused, Overcommitted.code: OvercommitRefused, LimitExceeded.code: CapRefused,
}


def error_for(refusal: Refusal) -> BrokerError:
    """The error to raise for ``refusal`` (its class is the one its code names)."""
    return _BY_CODE[refusal.code](refusal)


def refusal_of(error: BrokerError) -> Refusal | None:
    """The refusal ``error`` carries, if it is one :func:`error_for` made."""
    return error.refusal if isinstance(error, _Carrying) else None
