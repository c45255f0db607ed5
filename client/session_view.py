"""What both clients show of their session: read-only properties over the client core.

:class:`~.sync_client.BrokerClient` and :class:`~.async_client.AsyncBrokerClient` both
inherit it, so their public surfaces cannot drift here.  A subclass sets ``_core`` (a
:class:`~.core.ClientCore`) and ``_transport`` (anything with an ``endpoint``).
"""

from __future__ import annotations

from typing import Any


class SessionView:
    """The session's books and identity, read from the client core (no request is made)."""

    _core: Any
    _transport: Any

    @property
    def session_id(self) -> str | None:
        return self._core.session_id

    @property
    def endpoint(self) -> str:
        return self._transport.endpoint

    @property
    def page_bytes(self) -> int:
        """The size of one page of this session, in bytes."""
        return self._core.page_bytes

    @property
    def held_pages(self) -> int:
        """Pages handed to the caller and not yet released."""
        return self._core.credit.held_pages

    @property
    def uncharged_pages(self) -> int:
        """Held pages the broker does not charge (it lost this session's state and could not
        grant them again); they are given back first, with no request, as the caller releases."""
        return self._core.uncharged_pages

    @property
    def reserve_pages(self) -> int:
        return self._core.credit.reserve_pages

    @property
    def pools(self) -> dict[str, int]:
        return dict(self._core.pools)

    @property
    def holds(self) -> dict[str, int]:
        return dict(self._core.holds)

    @property
    def lease_s(self) -> float:
        return self._core.lease_s
