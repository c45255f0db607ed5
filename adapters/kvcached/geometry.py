"""What a kvcached pool is made of, in the units the governor counts (sans-I/O).

kvcached maps KV memory by *page id*: one page id is a **compound page** of
``page_size * num_layers * num_kv_buffers`` bytes (every layer's K and V of ``page_size``
bytes), in the contiguous and the per-layer layout alike.  Its allocator's size (``total
pages``) bounds what it maps: pages in use plus its prealloc reserve never exceed it.  So the
governor counts pool pages, and the broker's grant is converted between pool pages and the
session's pages (``session_pages_per_page``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolGeometry:
    """One pool's page geometry, from the arguments kvcached builds its ``PageAllocator`` with."""

    num_layers: int
    page_size: int  # bytes of one layer's K (or V) per page id: kvcached's PAGE_SIZE
    num_kv_buffers: int
    virtual_pages: int  # the pool's whole virtual range, in pool pages
    group_id: int = 0
    world_size: int = 1
    pp_rank: int = 0
    ipc_name: str = ""

    @property
    def page_bytes(self) -> int:
        """Bytes of one compound page (what one pool page costs when mapped)."""
        return self.page_size * self.num_layers * self.num_kv_buffers

    def limit_bytes(self, pages: int) -> int:
        return pages * self.page_bytes

    def pages_of(self, size_bytes: int) -> int:
        """Whole pool pages in ``size_bytes`` (rounded down)."""
        return max(0, size_bytes) // self.page_bytes

    def allocator_size(self, pages: int) -> int:
        """``PageAllocator.resize``'s argument for ``pages``: per-layer bytes of one K or V."""
        return pages * self.page_size


def session_pages_per_page(pool_page_bytes: int, session_page_bytes: int) -> int | None:
    """How many session pages one pool page is; None if they do not divide (cannot govern)."""
    if session_page_bytes <= 0 or pool_page_bytes % session_page_bytes:
        return None
    return pool_page_bytes // session_page_bytes
