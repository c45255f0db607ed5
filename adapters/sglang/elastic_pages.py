"""Elastic mode of a paged KV allocator: pages exist only as far as the broker grants them.

An allocator page is ``page_bytes`` of KV (every layer of ``page_size`` tokens); the broker
session counts pages of ``session_page_bytes``.  The gate converts between the two and keeps
``ElasticBudget`` (``adapters/elastic.py``) covering what the allocator hands out:

* before an allocation of ``n`` new pages, :meth:`ElasticGate.admit` makes sure the grant
  covers ``used + n`` pages, asking in batches through the client's credit reserve (and,
  with several TP ranks, through ``acquire_tp`` min-reduced over SGLang's TP CPU group);
  a refusal makes the allocation return None, which SGLang treats as out of memory;
* pages handed out are mapped by the physical backing, freed pages are unmapped, and the
  grant is trimmed with hysteresis (``ElasticBudget.trim``), so an allocator oscillating
  around a size makes no round trip per request.

Invariant: ``used_pages`` allocator pages are mapped, and the broker grant covers them:
``session_pages(used_pages) <= budget.granted_pages``.  A gate without a client (the
worker runs unprotected) grants itself, but still joins every TP min-reduce its peers make.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...client import BrokerClient
from .. import background
from ..backing import PhysicalBacking
from ..elastic import ElasticBudget, FailurePolicy


class ElasticGate:
    def __init__(
        self,
        client: BrokerClient | None,
        backing: PhysicalBacking,
        *,
        page_bytes: int,
        session_page_bytes: int,
        physical_pages: int,
        reduce_min: Callable[[int], int] | None = None,
        batch_pages: int = 16,
        on_failure: FailurePolicy | None = None,
    ):
        if page_bytes <= 0 or session_page_bytes <= 0:
            raise ValueError("page_bytes and session_page_bytes must be positive")
        self.backing = backing
        self.page_bytes = page_bytes
        self.session_page_bytes = session_page_bytes
        self.used_pages = 0
        self.budget = ElasticBudget(
            client, physical_pages=self.session_pages(physical_pages), batch_pages=batch_pages,
            reduce_min=reduce_min, on_failure=on_failure,
        )

    def session_pages(self, pages: int) -> int:
        """Broker pages that cover ``pages`` allocator pages (rounded up)."""
        return -(-pages * self.page_bytes // self.session_page_bytes)

    def admit(self, new_pages: int) -> bool:
        """True if ``new_pages`` more allocator pages are granted (asking the broker if needed)."""
        return self.budget.ensure(self.session_pages(self.used_pages + max(0, new_pages)))

    def taken(self, page_ids: Any) -> None:
        ids = [int(p) for p in page_ids.tolist()]
        if ids:
            self.backing.map_pages(ids)
            self.used_pages += len(ids)

    def returned(self, page_ids: Any) -> None:
        ids = [int(p) for p in page_ids.tolist()]
        if ids:
            self.backing.unmap_pages(ids)
            self.used_pages -= len(ids)
        self.budget.trim(self.session_pages(self.used_pages))

    @property
    def granted_session_pages(self) -> int:
        return self.budget.granted_pages

    def close(self) -> None:
        """Give the whole grant back."""
        self.budget.close()

    def close_later(self) -> None:
        """:meth:`close` on the adapter's background thread (safe from a finaliser, which may
        run in the middle of a request on the same session)."""
        background.submit(f"release elastic grant {id(self):x}", self.close)
