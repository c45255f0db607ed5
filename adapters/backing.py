"""Physical backing of an elastic KV pool: what makes a granted page real memory.

The broker decides *how many* pages a pool may use; a backing decides whether those pages
cost device memory only when used.  It is pluggable:

* :class:`PreallocatedBacking`: the runtime allocated the whole buffer up front (its normal
  behaviour).  Gating pages through the broker then bounds *use*, not memory, so adapters
  charge the whole buffer as a ``kv_static`` reservation instead of elastic pages.
* an on-demand backing (kvcached's VMM-mapped tensors today) maps a page's physical memory
  when it is granted and unmaps it when it goes back; only then are elastic grants real
  savings.  Adapters look it up with :func:`on_demand_backing`.
"""

from __future__ import annotations

from typing import Protocol, Sequence


class PhysicalBacking(Protocol):
    on_demand: bool

    def map_pages(self, page_ids: Sequence[int]) -> None: ...

    def unmap_pages(self, page_ids: Sequence[int]) -> None: ...


class PreallocatedBacking:
    on_demand = False

    def map_pages(self, page_ids: Sequence[int]) -> None:
        pass

    def unmap_pages(self, page_ids: Sequence[int]) -> None:
        pass


class RecordingBacking:
    """An on-demand backing that only records what is mapped (tests, CPU runs)."""

    on_demand = True

    def __init__(self) -> None:
        self.mapped: set[int] = set()

    def map_pages(self, page_ids: Sequence[int]) -> None:
        overlap = self.mapped.intersection(page_ids)
        if overlap:
            raise RuntimeError(f"pages mapped twice: {sorted(overlap)[:8]}")
        self.mapped.update(page_ids)

    def unmap_pages(self, page_ids: Sequence[int]) -> None:
        self.mapped.difference_update(page_ids)


_registered: PhysicalBacking | None = None


def register_on_demand_backing(backing: PhysicalBacking | None) -> None:
    """Install the backing elastic pools use (kvcached's integration registers its own)."""
    global _registered
    _registered = backing


def on_demand_backing() -> PhysicalBacking | None:
    return _registered
