"""Which pages of a paged KV allocator are handed out, so that stale frees can be dropped.

SGLang's paged allocator trusts every id it is given back: a double free puts a page on the
free list twice (two requests then share it), an id in ``[0, page_size)`` puts the padding
page 0 into circulation, and an id past the pool reads or writes out of range.  The tracker
keeps one flag per page (``in_use``, on the allocator's device) and filters every free:

* a token id whose page is outside ``[1, num_pages]`` is *out of range*;
* a token id whose page is not handed out is *stale* (already freed, or never allocated);
* everything else is kept, and its pages stop being in use.

Units: token ids (``page * page_size + offset``) and page ids, as SGLang uses them; counts
are ints.  Filtering costs one device sync per free, as SGLang's own ``torch.unique`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from .. import announce

log = announce.logger("kvcached_broker.adapters.sglang")


@dataclass
class StaleCounts:
    """Ids dropped before they reached the free list, logged once per allocator."""

    label: str
    dropped_ids: int = 0
    dropped_frees: int = 0

    def add(self, dropped: int, example: Any) -> None:
        if dropped <= 0:
            return
        self.dropped_ids += dropped
        self.dropped_frees += 1
        if self.dropped_frees == 1:
            log.warning(
                "event=sglang_stale_free allocator=%s dropped_ids=%d example=%s "
                "detail=stale_or_out_of_range_ids_ignored_further_drops_are_counted_not_logged",
                self.label, dropped, example,
            )


class PageTracker:
    """The in-use flag of every page (index 0, the padding page, is never in use)."""

    def __init__(self, num_pages: int, page_size: int, device: Any, label: str):
        self.page_size = page_size
        self.device = device
        self.stale = StaleCounts(label)
        self.reset(num_pages)

    def reset(self, num_pages: int) -> None:
        """Every page free (the allocator was cleared or resized)."""
        import torch

        self.num_pages = num_pages
        self.in_use = torch.zeros(num_pages + 1, dtype=torch.bool, device=self.device)

    def mark_token_ids(self, token_ids: Any) -> None:
        """The pages of ``token_ids`` were just handed out."""
        if token_ids is not None and token_ids.numel():
            self.in_use[token_ids // self.page_size] = True

    def _valid_pages(self, pages: Any) -> Any:
        in_range = (pages >= 1) & (pages <= self.num_pages)
        return in_range & self.in_use[pages.clamp(0, self.num_pages)]

    def release_token_ids(self, token_ids: Any, *, count: bool = True) -> tuple[Any, Any]:
        """``(kept token ids, pages they free)``; the pages stop being in use.

        ``count=False``: the dropped ids are not counted as stale (they go to upstream anyway).
        """
        import torch

        pages = token_ids // self.page_size
        keep = self._valid_pages(pages)
        kept = token_ids[keep]
        if count:
            self._count(token_ids, keep, token_ids.numel() - kept.numel())
        freed = torch.unique(pages[keep])
        self.in_use[freed] = False
        return kept, freed

    def release_page_ids(self, page_ids: Any, *, count: bool = True) -> Any:
        """The distinct valid pages of ``page_ids``; they stop being in use."""
        import torch

        keep = self._valid_pages(page_ids)
        freed = torch.unique(page_ids[keep])
        if count:
            self._count(page_ids, keep, page_ids.numel() - freed.numel())
        self.in_use[freed] = False
        return freed

    def in_range_token_ids(self, token_ids: Any) -> Any:
        """Token ids whose page exists (for frees deferred by a free group)."""
        pages = token_ids // self.page_size
        keep = (pages >= 1) & (pages <= self.num_pages)
        kept = token_ids[keep]
        self._count(token_ids, keep, token_ids.numel() - kept.numel())
        return kept

    def _count(self, ids: Any, keep: Any, dropped: int) -> None:
        if dropped > 0:
            self.stale.add(dropped, _example(ids, keep))

    def snapshot(self) -> Any:
        return self.in_use.clone()

    def restore(self, in_use: Any) -> None:
        """Go back to a snapshot (the allocator restored its own state)."""
        self.in_use = in_use.clone()


def _example(ids: Any, keep: Any) -> Any:
    dropped = ids[~keep]
    return dropped[:4].tolist() if dropped.numel() else []

