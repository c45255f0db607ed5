"""When a pool grows, gives back, or holds (sans-I/O: page counts in, one decision out).

Invariants the governor keeps with these decisions (pool pages):

* ``limit <= granted``: a grant is taken before the limit rises, and the limit is lowered (and
  kvcached reports it applied) before pages go back;
* ``limit <= min(operator cap, virtual pages)``;
* ``inuse + reserve <= limit`` is kvcached's own (its allocator's size bounds what it maps).

Hysteresis: a pool grows by ``batch_pages`` once fewer than ``low_pages`` of its limit are
free, so the engine's allocation path rarely waits on the broker; it gives back what is free
beyond ``high_pages``, down to ``batch_pages`` free, so a pool that oscillates around a size
makes no round trip per allocation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_BATCH_BYTES = 512 << 20


@dataclass(frozen=True)
class Watermarks:
    """In pool pages: ``low_pages < batch_pages < high_pages``."""

    batch_pages: int
    low_pages: int
    high_pages: int
    floor_pages: int = 1  # the page holding kvcached's null block

    @classmethod
    def for_page_bytes(cls, page_bytes: int, batch_bytes: int = DEFAULT_BATCH_BYTES) -> "Watermarks":
        batch = max(2, math.ceil(batch_bytes / page_bytes))
        return cls(batch_pages=batch, low_pages=max(1, batch // 2), high_pages=2 * batch)


@dataclass(frozen=True)
class PoolPages:
    """What a pool has, in pool pages."""

    inuse: int  # pages holding blocks (kvcached's in-use pages)
    limit: int  # kvcached's allocator size: the bound on mapped pages
    granted: int  # what the broker granted this pool
    ceiling: int  # min(operator cap, virtual pages): never grow past it

    @property
    def free(self) -> int:
        return max(0, self.limit - self.inuse)


@dataclass(frozen=True)
class Grow:
    pages: int  # ask the broker for this many
    min_pages: int  # and take no fewer


@dataclass(frozen=True)
class Shrink:
    limit: int  # lower kvcached's limit to this (>= inuse: applies at once)


@dataclass(frozen=True)
class Hold:
    pass


Decision = Grow | Shrink | Hold


def decide(pages: PoolPages, marks: Watermarks, *, short_pages: int = 0) -> Decision:
    """The next step for a pool; ``short_pages`` is what a refused allocation still needed."""
    if pages.limit > pages.ceiling:
        return Shrink(max(pages.ceiling, pages.inuse))
    room = pages.ceiling - pages.limit
    if (pages.free < marks.low_pages or short_pages > 0) and room > 0:
        want = min(room, max(marks.batch_pages, short_pages))
        return Grow(want, min(want, max(1, short_pages)))
    if pages.free > marks.high_pages:
        return Shrink(max(marks.floor_pages, pages.inuse + marks.batch_pages))
    return Hold()


def initial_pages(marks: Watermarks, virtual_pages: int) -> int:
    """What a new pool asks for at construction: its null-block page and one batch."""
    return max(1, min(virtual_pages, marks.floor_pages + marks.batch_pages))


def give_back_plan(pages: PoolPages, wanted: int, floor_pages: int) -> tuple[int, int]:
    """For a pressure ask of ``wanted`` pool pages: ``(limit now, deferred limit)``.

    The first lowers the limit over free pages only (applies at once); the second, if the
    free pages were not enough, goes below what is in use and applies once blocks are freed.
    """
    now = max(pages.inuse, pages.limit - wanted, floor_pages)
    rest = wanted - (pages.limit - now)
    later = max(floor_pages, now - rest) if rest > 0 else now
    return now, later
