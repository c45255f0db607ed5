"""A pool's grant, in pool pages, through its process's per-device broker session.

The session (``adapters/device_session.py``) counts pages of ``client.page_bytes``; a pool page (a
kvcached compound page) is ``ratio`` of them.  Every call goes through the session's ``guard``: a
refusal is 0 pages (a scheduling miss), a broker failure turns the process unprotected and
returns None, an eviction is raised (fatal).

Invariant: :attr:`pages` is what this pool holds from the broker; the session holds at least
``pages * ratio`` session pages (other reporters may hold more on the same session).

A governor uses any object with the interface :class:`Grants`, which both backends implement:
:class:`SessionGrants` when the pool's memory is mapped in this process (``maps_here``),
``broadcast.board_grants.BoardGrants`` when it is mapped in tensor-parallel workers that hold
the grants themselves (``maps_here`` False: the workers report what they map, and the reports
below are theirs to make).
"""

from __future__ import annotations

from typing import Protocol

from .. import announce, sessions
from ..device_session import DeviceSession
from ..worker_identity import WorkerIdentity
from . import pressure
from .geometry import PoolGeometry, session_pages_per_page

log = announce.logger("kvcached_broker.adapters")


class Grants(Protocol):
    """What a governor needs of a pool's grants, in pool pages.

    ``maps_here``: the pool's pages are mapped in this process, so the governor reports how many
    are mapped and idle (:meth:`mapped`, :meth:`idle`), says in a release what it still maps,
    and shrinks kvcached's allocator when the pool closes.  Where it is False those calls are
    accepted and do nothing, and ``mapped``/``key`` of a release are ignored.

    ``ratio``: session pages per pool page (a broker's pressure asks are in session pages; 1
    where the grants are not a session's)."""

    maps_here: bool
    ratio: int

    @property
    def pages(self) -> int: ...
    def lost(self) -> str | None: ...
    def acquire(self, pages: int, min_pages: int, *, wait_s: float | None = None) -> int | None: ...
    def release(self, pages: int, *, mapped: int | None = None, key: str | None = None) -> bool: ...
    def mapped(self, key: str, pages: int) -> None: ...
    def idle(self, key: str, pages: int) -> None: ...
    def uncharged_pages(self) -> int: ...
    def unasked_shortfall(self) -> int: ...
    def report(self, key: str, pools: dict[str, int], *, usage: dict[str, int] | None = None,
               allocated: bool = True) -> bool: ...
    def forget(self, key: str) -> None: ...
    def forget_report(self, key: str) -> None: ...
    def poll(self) -> int: ...


class SessionGrants:
    """A pool's grant through this process's own broker session (the memory is mapped here)."""

    maps_here = True

    def __init__(self, session: DeviceSession, ratio: int):
        self.session = session
        self.identity = session.identity
        self.client = session.client
        self.ratio = ratio  # session pages per pool page
        self.pages = 0

    @classmethod
    def open(cls, identity: WorkerIdentity, geometry: PoolGeometry) -> "tuple[SessionGrants | None, str]":
        """The pool's grants, or (None, why not) when the pool cannot be governed."""
        session = sessions.session(identity)
        if session is None:
            return None, f"unprotected ({sessions.unprotected_reason(identity) or 'no broker'})"
        ratio = session_pages_per_page(geometry.page_bytes, session.client.page_bytes)
        if ratio is None:
            return None, (f"page size mismatch: a pool page is {geometry.page_bytes} bytes, "
                          f"the session's page {session.client.page_bytes}")
        if session.pin_base() is None:
            return None, f"unprotected ({sessions.unprotected_reason(identity) or 'no broker'})"
        return cls(session, ratio), ""

    def lost(self) -> str | None:
        """Why this pool's session can no longer be used (the process turned unprotected: a
        failure of any reporter of the process counts), or None while it can."""
        return self.session.unusable_reason()

    def acquire(self, pages: int, min_pages: int, *, wait_s: float | None = None) -> int | None:
        """Pool pages granted (between ``min_pages`` and ``pages``, or 0); None if unprotected.
        ``wait_s``: an ask that does not fit waits at the broker up to that long."""
        ratio = self.ratio
        got = self.session.guard("kvcached acquire",
                                 lambda: self.client.acquire(pages * ratio, min_pages=min_pages * ratio, wait_s=wait_s))
        if got is None:
            return None
        whole, odd = divmod(got, ratio)
        if odd and self.session.guard("kvcached release", lambda: _released(self.client, odd)) is None:
            return None
        self.pages += whole
        return whole

    def release(self, pages: int, *, mapped: int | None = None, key: str | None = None) -> bool:
        """Give ``pages`` pool pages back; False if the process turned unprotected.  ``mapped``
        (with the pool's ``key``): the pool pages it still maps, said in the same request."""
        pages = min(pages, self.pages)
        if pages <= 0:
            return True
        if mapped is not None and key is not None:
            if not self.session.release_mapped(key, pages * self.ratio, min(mapped, self.pages) * self.ratio):
                return False
        elif self.session.guard("kvcached release", lambda: _released(self.client, pages * self.ratio)) is None:
            return False
        self.pages -= pages
        return True

    def idle(self, key: str, pages: int) -> None:
        """The pool ``key`` holds ``pages`` pool pages idle (free, or its prefix cache's unused
        blocks): said with the session's next request."""
        self.session.report_idle(key, min(pages, self.pages) * self.ratio)

    def mapped(self, key: str, pages: int) -> None:
        """The pool ``key`` has ``pages`` pool pages mapped now (in use and kvcached's reserve):
        the broker charges the rest of its grant as promised memory."""
        self.session.report_mapped(key, min(pages, self.pages) * self.ratio)

    def uncharged_pages(self) -> int:
        """Session pages the broker no longer charges this session for (a short re-assertion)."""
        return pressure.uncharged_pages(self.client)

    def unasked_shortfall(self) -> int:
        """Uncharged session pages the session's pools were not asked back for yet."""
        return pressure.unasked_shortfall(self.client)

    def report(self, key: str, pools: dict[str, int], *, usage: dict[str, int] | None = None,
               allocated: bool = True) -> bool:
        """Report this pool's own reservations on the session; False if the process is
        unprotected.  Raises ``BudgetExceeded`` when the broker refuses them."""
        return self.session.report(key, pools, usage=usage, allocated=allocated) is not None

    def forget(self, key: str) -> None:
        self.session.forget(key)

    def forget_report(self, key: str) -> None:
        """What was reported under ``key`` goes (the pool reports under another key now)."""
        self.session.forget(key)

    def poll(self) -> int:
        """Pool pages the broker asked back since the last call: 0 here (pressure arrives
        through the client's callback, :mod:`.pressure`)."""
        return 0


def _released(client, session_pages: int) -> bool:
    """``client.release`` returns None; a session's ``guard`` says None for unprotected."""
    client.release(session_pages)
    return True
