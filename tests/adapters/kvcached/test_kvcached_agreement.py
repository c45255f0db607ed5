"""kvcached's sync-point agreement alone: a pool's give-back routed through the agreement
(:class:`agreement.AgreedGrants`) still says what the governor says with it.  The pool's allocator
and grant are small stand-ins; the sync points themselves run in the kvcached+SGLang overlay
tests (tests/adapters/sglang/test_kvcached_sglang_*)."""

from __future__ import annotations

from kvcached_broker.adapters.kvcached import agreement


class Allocator:
    def __init__(self, total_pages: int):
        self.total_pages = total_pages

    def get_num_total_pages(self) -> int:
        return self.total_pages


class Grants:
    """A session grant as the governor gives back through it (``release(pages, mapped=, key=)``)."""

    maps_here, ratio = True, 1

    def __init__(self, pages: int):
        self.pages, self.calls = pages, []

    def release(self, pages: int, *, mapped: int | None = None, key: str | None = None) -> bool:
        self.calls.append((pages, mapped, key))
        self.pages -= pages
        return True


class Governor:
    def __init__(self, grants: Grants, allocator: Allocator, manager: object):
        self.grants, self.real, self.governed, self.key = grants, allocator, True, "kvcached:mha:g0:1"
        self._manager = manager

    def manager(self) -> object:
        return self._manager

    def route(self) -> None:
        """As ``AgreedLimits.route_releases`` does when a governor of the session's grants is built."""
        self.grants = agreement.AgreedGrants(self.grants, agreement.Agreement(), self)


class Manager:
    """Stands in for kvcached's manager: only its identity (a weak reference) is used."""


def test_a_release_through_the_sync_points_says_the_mapped_pages_with_it():
    grants, manager = Grants(10), Manager()
    governor = Governor(grants, Allocator(6), manager)
    governor.route()

    assert governor.grants.release(4, mapped=5, key=governor.key)
    assert grants.calls == [(4, 5, governor.key)] and grants.pages == 6


def test_the_agreement_gives_back_nothing_the_pools_size_still_uses_and_says_so():
    grants, manager = Grants(10), Manager()
    governor = Governor(grants, Allocator(8), manager)
    governor.route()

    assert governor.grants.release(4, mapped=7, key=governor.key)
    assert grants.calls == [(2, 7, governor.key)] and grants.pages == 8  # only what is above its size


def test_a_release_before_the_pool_is_known_goes_straight_to_the_grant():
    grants = Grants(10)
    governor = Governor(grants, Allocator(8), None)
    governor.route()

    assert governor.grants.release(4, mapped=3, key=governor.key)
    assert grants.calls == [(4, 3, governor.key)]  # no sync point holds an offer of a pool it has not seen
