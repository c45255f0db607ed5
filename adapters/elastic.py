"""A broker-gated page budget for an elastic KV pool (used by the SGLang and vLLM adapters).

The pool may hand out only pages the broker has granted.  :meth:`ElasticBudget.ensure` is
called before an allocation would fail and asks for more in batches; :meth:`ElasticBudget.trim`
gives back what the pool does not use, with hysteresis so that a pool oscillating around a
size does not make a round trip per allocation.  Both go through the client's credit reserve,
and across TP ranks through ``acquire_tp`` with the runtime's min-reduce, so every rank holds
the same number of pages.

Invariant: ``granted_pages`` is what this pool may use: what it holds from the broker, or,
once it runs without one, what it counts for itself; the pool's usable capacity is
``min(granted_pages, physical_pages)``.

Failing safe.  A budget with no client (the worker is unprotected) counts pages for itself
and still calls ``reduce_min`` exactly once per :meth:`ensure`, as a protected rank does
inside ``acquire_tp``, so TP ranks that differ in protection never deadlock.  A broker
failure while serving is a miss this time; ``on_failure`` then decides whether the budget
goes on without the broker (it drops its client) or keeps asking.  An eviction is raised.
"""

from __future__ import annotations

import logging
from typing import Callable

from ..client import BrokerClient, BrokerError

#: ``on_failure(action, error)``: True to go on without the broker (the worker is unprotected)
FailurePolicy = Callable[[str, BrokerError], bool]

log = logging.getLogger("kvcached_broker.adapters")


class ElasticBudget:
    def __init__(
        self,
        client: BrokerClient | None,
        *,
        physical_pages: int,
        batch_pages: int = 16,
        slack_pages: int | None = None,
        reduce_min: Callable[[int], int] | None = None,
        on_failure: FailurePolicy | None = None,
    ):
        if physical_pages < 0 or batch_pages < 1:
            raise ValueError("physical_pages must be >= 0 and batch_pages >= 1")
        self.client = client
        self.physical_pages = physical_pages
        self.batch_pages = batch_pages
        self.slack_pages = 2 * batch_pages if slack_pages is None else slack_pages
        self.reduce_min = reduce_min
        self.on_failure = on_failure
        self.granted_pages = 0
        self.refusals = 0

    def ensure(self, needed_pages: int) -> bool:
        """Make at least ``needed_pages`` usable; False (a scheduling miss) if refused."""
        if needed_pages <= self.granted_pages:
            return True
        if needed_pages > self.physical_pages:
            return False
        want = min(self.physical_pages, needed_pages + self.batch_pages) - self.granted_pages
        floor = needed_pages - self.granted_pages
        got = self._take(want, floor)
        self.granted_pages += got
        if got < floor:
            self.refusals += 1
            return False
        return True

    @property
    def protected(self) -> bool:
        return self.client is not None

    def _take(self, want: int, floor: int) -> int:
        """Pages granted now (the TP minimum with several ranks); 0 on a refusal or a failure."""
        if self.client is None:  # unprotected: count for ourselves, still join the collective
            return int(self.reduce_min(want)) if self.reduce_min is not None else want
        try:
            if self.reduce_min is not None:
                return self.client.acquire_tp(want, self.reduce_min, min_pages=floor)
            return self.client.acquire(want, min_pages=floor)
        except BrokerError as exc:
            self.failed("acquire", exc)
            return 0

    def failed(self, action: str, exc: BrokerError) -> None:
        if exc.fatal:
            raise exc
        log.warning("event=elastic_miss action=%s reason=%r", action, str(exc))
        if self.on_failure is not None and self.on_failure(action, exc):
            self.client = None

    def trim(self, used_pages: int) -> int:
        """Give back granted pages beyond ``used_pages + slack``; returns how many went back."""
        surplus = self.granted_pages - used_pages - self.slack_pages
        if surplus <= 0:
            return 0
        give = self.granted_pages - used_pages - self.batch_pages
        if give <= 0:
            return 0
        if self.client is not None:
            try:
                self.client.release(give)
            except BrokerError as exc:
                self.failed("release", exc)
        self.granted_pages -= give
        return give

    def close(self) -> None:
        if self.granted_pages and self.client is not None:
            try:
                self.client.release(self.granted_pages)
            except BrokerError:
                pass
        self.granted_pages = 0
