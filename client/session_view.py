"""What both clients show of their session: read-only properties over the client core.

:class:`~.sync_client.BrokerClient` and :class:`~.async_client.AsyncBrokerClient` both
inherit it, so their public surfaces cannot drift here.  A subclass sets ``_core`` (a
:class:`~.core.ClientCore`) and ``_transport`` (anything with an ``endpoint``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from . import results
    from .core import ClientCore


class _HasEndpoint(Protocol):
    endpoint: str


class SessionView:
    """The session's books and identity, read from the client core (no request is made)."""

    _core: ClientCore
    _transport: _HasEndpoint

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
        return self._core.visible_uncharged_pages()

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
    def report_mapping(self) -> bool:
        """Whether this session says which of its pages are mapped (``connect(report_mapping=True)``)."""
        return self._core.report_mapping

    @property
    def mapped_pages(self) -> int:
        """The mapped pages this session last reported (0 unless it reports mapping)."""
        return self._core.mapped_pages

    @property
    def last_reserve(self) -> results.ReserveResult | None:
        """The broker's whole answer to this session's last reserve (None before the first):
        ``pools``, ``holds``, ``measured_bytes``, and the instance's ``grantable_bytes`` and
        ``ever_bytes`` after it."""
        return self._core.last_reserve

    @property
    def last_acquire(self) -> results.AcquireResult | None:
        """The broker's whole answer to this session's last ``acquire`` that made a round trip
        (None before the first): ``granted``, ``granted_pages``, ``refused`` (a refusal),
        ``waited_s`` (an ask that waited for memory: how long)."""
        return self._core.last_acquire

    @property
    def lease_s(self) -> float:
        return self._core.lease_s
