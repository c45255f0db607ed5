"""Asks that wait at the broker for memory to come back (``acquire``'s ``wait_s``; no I/O).

A refused ``acquire`` with ``wait_s`` is not answered at once: it waits here, and the request
core grants it as soon as it fits (a release, a closed session, a device reading that shows
memory unmapped), or answers it with the refusal it would get then once ``wait_s`` has passed.
So a bursting worker is granted in the round its neighbour gives memory back, instead of
backing off and asking again.

Invariants:

* an ask waits at most once: the same request id sent again while it waits (a client's resend)
  is answered only once, when the ask ends;
* nothing is charged while an ask waits; its grant, when it comes, passes admission like any
  (floors, caps, budget) and is journaled in the round it is made, before its reply is sent;
* the asks of the instance furthest below its fair share are tried first, then the oldest.

Units: pages as ints, times in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(eq=False)
class WaitingAsk:
    """One ``acquire`` waiting for room: what it asked and how its reply is cached."""

    session_id: str
    request_id: int
    body_hash: int  # the reply cache's fingerprint of the request's bytes
    pages: int
    min_pages: int | None
    mapped: bool
    caller_pages: int | None
    caller_min_pages: int | None
    since_s: float
    deadline_s: float

    @property
    def floor_pages(self) -> int:
        """The fewest pages that answer it."""
        return self.pages if self.min_pages is None else max(1, self.min_pages)


class WaitingAsks:
    """The asks waiting, by session and request id."""

    def __init__(self) -> None:
        self._asks: dict[tuple[str, int], WaitingAsk] = {}

    def __bool__(self) -> bool:
        return bool(self._asks)

    def __len__(self) -> int:
        return len(self._asks)

    def add(self, ask: WaitingAsk) -> None:
        self._asks[(ask.session_id, ask.request_id)] = ask

    def waiting(self, session_id: str, request_id: int) -> bool:
        return (session_id, request_id) in self._asks

    def remove(self, ask: WaitingAsk) -> None:
        self._asks.pop((ask.session_id, ask.request_id), None)

    def all(self) -> list[WaitingAsk]:
        """Every waiting ask, oldest first."""
        return sorted(self._asks.values(), key=lambda a: a.since_s)

    def of_instance_bytes(self, page_bytes_of: dict[str, int], session_ids: set[str]) -> tuple[int, int]:
        """``(asks, bytes)`` waiting for the sessions ``session_ids`` (status)."""
        count = total = 0
        for ask in self._asks.values():
            if ask.session_id in session_ids:
                count += 1
                total += ask.pages * page_bytes_of.get(ask.session_id, 0)
        return count, total
