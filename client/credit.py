"""The client's credit reserve: granted pages kept at hand so most allocations need no round trip.

The broker charges a session for every page it grants, including the pages its client keeps
unused in this reserve (status shows them as ``reserve_pages``, a part of
``granted_pages``).  Watermarks, in pages:

* ``target``: what a refill tops the reserve up to (``credit_pages``);
* ``high = 2 * target``: above it, the surplus down to ``target`` goes back to the broker;
* ``low = target // 2``: below it, a background refill tops up to ``target``.

The gap between ``low`` and ``high`` is hysteresis: a worker that allocates and frees pages
one at a time never makes a round trip.  ``credit_pages=0`` turns the reserve off: every call
goes to the broker and every freed page goes straight back.

Invariant: ``reserve_pages + held_pages`` equals what the broker has granted this session.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import BadRequest

#: The default reserve holds about this much memory (but at least one page, at most 32).
DEFAULT_CREDIT_BYTES = 64 << 20
MAX_DEFAULT_CREDIT_PAGES = 32


def default_credit_pages(page_bytes: int) -> int:
    return max(1, min(MAX_DEFAULT_CREDIT_PAGES, DEFAULT_CREDIT_BYTES // max(1, page_bytes)))


def split_grant(reserve_pages: int, granted: int, pages: int, min_pages: int | None) -> tuple[int, int]:
    """How a grant is shared between a caller who asked for ``pages`` (at least ``min_pages``)
    and the reserve: ``(pages for the caller, reserve afterwards)``.

    The broker makes the same split when it answers, so status shows the reserve exactly as
    soon as the grant is answered.
    """
    floor = pages if min_pages is None else min_pages
    available = reserve_pages + granted
    give = min(pages, available)
    if give < floor or give == 0:
        give = 0
    return give, available - give


@dataclass
class CreditReserve:
    target_pages: int
    reserve_pages: int = 0
    held_pages: int = 0  # pages handed to the caller and not yet released
    used: bool = False  # no background refill for a session that never asked for a page

    def __post_init__(self) -> None:
        if self.target_pages < 0:
            raise ValueError(f"credit_pages must be >= 0, got {self.target_pages}")

    @property
    def high_pages(self) -> int:
        return 2 * self.target_pages

    @property
    def low_pages(self) -> int:
        return self.target_pages // 2

    @property
    def granted_pages(self) -> int:
        return self.reserve_pages + self.held_pages

    def take(self, pages: int) -> bool:
        """Serve ``pages`` from the reserve alone, if it holds that many."""
        self.used = True
        if self.reserve_pages >= pages:
            self.reserve_pages -= pages
            self.held_pages += pages
            return True
        return False

    def ask(self, pages: int, min_pages: int | None) -> tuple[int, int]:
        """What to ask the broker for when the reserve is short: ``(pages, min_pages)``.

        The part the caller needs is the minimum; the refill on top is taken only if it fits.
        """
        floor = pages if min_pages is None else min_pages
        need = pages - self.reserve_pages
        return need + self.target_pages, max(0, floor - self.reserve_pages)

    def settle(self, pages: int, min_pages: int | None, granted: int) -> int:
        """Book ``granted`` pages from the broker; return how many the caller gets (0: refused)."""
        give, self.reserve_pages = split_grant(self.reserve_pages, granted, pages, min_pages)
        self.held_pages += give
        return give

    def put_back(self, pages: int) -> int:
        """The caller frees ``pages``.  Returns the surplus to send back to the broker now,
        already taken out of the reserve (put it back with :meth:`reattach` if that fails)."""
        if pages > self.held_pages:
            raise BadRequest(
                f"release of {pages} page(s) but only {self.held_pages} are held",
                details={"pages": pages, "held_pages": self.held_pages},
            )
        self.held_pages -= pages
        self.reserve_pages += pages
        return self.trim()

    def trim(self) -> int:
        """Take the surplus above the high watermark out of the reserve (a late grant, say)."""
        if self.reserve_pages > self.high_pages:
            return self.detach(self.reserve_pages - self.target_pages)
        return 0

    def detach(self, pages: int) -> int:
        """Take up to ``pages`` out of the reserve to give back (under pressure, say)."""
        taken = min(pages, self.reserve_pages)
        self.reserve_pages -= taken
        return taken

    def reattach(self, pages: int) -> None:
        """Pages that could not be given back stay in the reserve (they are still charged)."""
        self.reserve_pages += pages

    def refill_wanted(self) -> int:
        if self.used and self.target_pages and self.reserve_pages < self.low_pages:
            return self.target_pages - self.reserve_pages
        return 0
