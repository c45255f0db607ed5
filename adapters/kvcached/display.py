"""What a governed pool shows outside its governor: its limit in kvctl's ``/dev/shm`` segment (and
an operator's cap read back from there), its zero page and limit views in the broker's status,
and its entry in the adapters' status (``kvcached_broker.adapters.kvcached.status()``).

:class:`PoolDisplay` is one of the governor's collaborators (:mod:`.governor`).  It reads no
kvcached object and decides nothing about the limit: the governor gives it the page counts it
read, and the pool's state (:mod:`.pool_state`) says what a cap changes (K2) and what the broker
was told already (``Told``).  It performs the I/O of showing: the segment's exchange
(:class:`.kvctl.KvctlSegment`) and the grants' ``report``.  Units: pool pages unless a name
says bytes.
"""

from __future__ import annotations

from typing import Any

from ...client import BudgetExceeded
from .. import announce
from . import segment
from .geometry import PoolGeometry
from .grants import Grants
from .kvctl import KvctlSegment
from .policy import PoolPages
from .pool_state import PoolState

log = announce.logger("kvcached_broker.adapters")

#: The pool the zero page is reported as: kvcached's zero page (one compound page per pool) is
#: physical memory outside the pool's pages.
ZERO_PAGE_POOL = "kvcached_zero_page"


class PoolDisplay:
    """The pool's name (``key``: what it reports under; ``pool_name``: kvcached's, once known),
    its kvctl segment, and what it shows in the broker's status."""

    def __init__(self, geometry: PoolGeometry, state: PoolState, key: str):
        self.geometry = geometry
        self.state = state
        self.key = key
        self.pool_name = ""
        self.kvctl = KvctlSegment(geometry, lambda: self.key)

    # ------------------------------------------------------------ the pool's name
    def name(self, pool_name: str, grants: Grants | None) -> None:
        """kvcached named the pool: report under a key with that name from now on."""
        self.pool_name = pool_name
        if pool_name:
            self._rename(f"kvcached:{pool_name}:g{self.geometry.group_id}:{self.key.rsplit(':', 1)[1]}", grants)

    def _rename(self, key: str, grants: Grants | None) -> None:
        """Report under ``key`` from now on; the zero page reported under the old key moves to it
        (reported again first, then the old entry forgotten: never charged twice, never zero)."""
        old, self.key = self.key, key
        if old == key or grants is None or not self.state.told.renamed():
            return
        self.report_zero_page(grants)
        if self.state.told.zero_page:
            grants.forget_report(old)  # never forget(): for board grants that ends the pool's board

    # ------------------------------------------------------------ kvctl's segment
    def read_cap(self, grants: Grants | None) -> None:
        """An operator's cap from the segment (``kvctl limit``), if it changed (:mod:`.kvctl`)."""
        self._take_cap(self.kvctl.read(), grants)

    def show_limit(self, limit_pages: int, grants: Grants | None) -> None:
        """Show the limit (a deferred one while it waits) in the segment, and take a cap it brings."""
        shown = self.state.pending_limit if self.state.pending_limit is not None else limit_pages
        self._take_cap(self.kvctl.show(self.geometry.limit_bytes(shown)), grants)

    def _take_cap(self, shared: "segment.Shared | None", grants: Grants | None) -> None:
        """K2: a cap the segment brings; the grant is read only for the log line of a new one."""
        if shared is None:
            return
        cap = None if shared.cap_bytes is None else self.geometry.pages_of(shared.cap_bytes)
        if not self.state.take_cap(cap):
            return
        granted_pages = grants.pages if grants else 0
        if cap is None:
            log.info("event=kvcached_operator_cap pool=%s cap_bytes=none detail=the cap was the start-up write "
                     "of a pool sharing the segment", self.key)
            return
        log.info("event=kvcached_operator_cap pool=%s cap_bytes=%d granted_bytes=%d detail=%s", self.key,
                 shared.cap_bytes, self.geometry.limit_bytes(granted_pages),
                 "a cap below the grant lowers the limit" if cap < granted_pages
                 else "the grant bounds the pool, not the cap")

    # ------------------------------------------------------------ the broker's status
    def report_zero_page(self, grants: Grants) -> None:
        """kvcached's zero page (one compound page per pool) is physical memory outside the pages."""
        try:
            if grants.report(self.key, {ZERO_PAGE_POOL: self.geometry.page_bytes}, allocated=False):
                self.state.told.zero_page = True
        except BudgetExceeded as exc:
            if self.state.told.zero_page_refused():
                log.warning("event=kvcached_zero_page_unreported pool=%s detail=%s (charged as measured "
                            "usage meanwhile; reported once there is room)", self.key, exc)

    def publish(self, grants: Grants, limit_pages: int) -> None:
        """Show the pool's limit and pending give-back in status (usage views, never charged)."""
        if grants.uncharged_pages():
            return  # the broker charges less than the pools hold: views above its charge are refused
        told = self.state.told
        if not told.zero_page:
            self.report_zero_page(grants)
            if not told.zero_page:
                return
        name = self.pool_name or f"g{self.geometry.group_id}"
        # Views may not exceed what the session holds (the broker refuses them), so an operator
        # cap above the grant is not shown here: the limit is what binds.
        views = {f"kvcached.{name}.limit": self.geometry.limit_bytes(limit_pages)}
        pending = self.state.pending_limit
        if pending is not None:
            views[f"kvcached.{name}.pending_release"] = self.geometry.limit_bytes(max(0, limit_pages - pending))
        shown = tuple(sorted(views.items()))
        if not told.views_news(shown):
            return
        try:
            if grants.report(self.key, {ZERO_PAGE_POOL: self.geometry.page_bytes}, usage=views):
                told.told_views(shown)
        except BudgetExceeded:
            pass

    # ------------------------------------------------------------ the adapters' status
    def status(self, pages: PoolPages, reserve_pages: int, counters: dict[str, int], *,
               uncharged_pages: int, kvctl_target_bytes: int | None) -> dict[str, Any]:
        """This pool as the governor sees it (bytes, and pool pages where named), from what the
        governor read of kvcached (``pages``, ``reserve_pages``) and of its grants."""
        g, state = self.geometry, self.state
        cap, pending = state.operator_cap_pages, state.pending_limit
        return {
            "pool": self.pool_name, "key": self.key, "group_id": g.group_id, "ipc_name": g.ipc_name,
            "governed": state.governed, "why_ungoverned": state.why_ungoverned, "page_bytes": g.page_bytes,
            "limit_bytes": g.limit_bytes(pages.limit), "granted_bytes": g.limit_bytes(pages.granted),
            "mapped_bytes": g.limit_bytes(pages.inuse + reserve_pages), "inuse_pages": pages.inuse,
            "reserve_pages": reserve_pages, "virtual_bytes": g.limit_bytes(g.virtual_pages),
            "operator_cap_bytes": None if cap is None else g.limit_bytes(cap),
            "pending_limit_bytes": None if pending is None else g.limit_bytes(pending),
            "blocked": state.blocked, "revision": state.revision, "kvctl_target_bytes": kvctl_target_bytes,
            "uncharged_pages": uncharged_pages, "reported_mapped_pages": state.told.mapped_pages,
            "segment_untrusted": self.kvctl.unsafe,
            **counters,
        }
