"""The GPU worker's side of an elastic KV cache: broker pages that back usable blocks.

With an on-demand backing registered, vLLM's KV buffer is virtual and costs memory only
where pages are mapped.  :class:`WorkerKVPages` holds this worker's pages from its own GPU's
broker (through the client's credit reserve) and maps them in the backing.  The scheduler's
:class:`~.block_pool.ElasticBlockGate` (in EngineCore) decides how many blocks are usable and
asks every worker to :meth:`WorkerKVPages.resize` to that many; see :mod:`.engine`.

Page ``k`` backs buffer bytes ``[k * page_bytes, (k + 1) * page_bytes)`` of the worker's
elastic address space, in which block ``b`` takes ``[b * bytes_per_block, (b + 1) *
bytes_per_block)``; usable blocks are always the prefix ``[0, usable_blocks)`` (block 0 is
vLLM's null block).

Invariant: ``granted_pages * page_bytes >= usable_blocks * bytes_per_block``, and pages
``[0, granted_pages)`` are exactly the ones mapped in the backing.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ...client import BrokerClient, BrokerError
from .. import worker
from ..backing import PhysicalBacking
from ..elastic import ElasticBudget
from ..worker import WorkerIdentity
from . import kv_budget, kv_config

log = logging.getLogger("kvcached_broker.adapters.vllm")

#: pages taken when the buffer is allocated, before the scheduler asks (covers the null block)
INITIAL_PAGES = 1


class WorkerKVPages:
    """One worker's pages over its KV buffer (sizes in blocks, pages and bytes as named)."""

    def __init__(
        self, client: BrokerClient | None, backing: PhysicalBacking, *, num_blocks: int, bytes_per_block: int,
        page_bytes: int, identity: WorkerIdentity | None = None,
    ):
        if num_blocks < 1 or bytes_per_block < 1 or page_bytes < 1:
            raise ValueError("num_blocks, bytes_per_block and page_bytes must be >= 1")
        self.backing = backing
        self.num_blocks = num_blocks
        self.bytes_per_block = bytes_per_block
        self.page_bytes = page_bytes
        on_failure = None if identity is None else (
            lambda action, exc: worker.serving_failure(identity, f"elastic {action}", exc))
        self.budget = ElasticBudget(client, physical_pages=self.pages_for(num_blocks), batch_pages=1, slack_pages=0,
                                    on_failure=on_failure)
        self._lock = threading.Lock()

    @property
    def granted_pages(self) -> int:
        return self.budget.granted_pages

    @property
    def usable_blocks(self) -> int:
        """Blocks (the null block included) the granted pages fully back."""
        return min(self.num_blocks, self.granted_pages * self.page_bytes // self.bytes_per_block)

    def pages_for(self, blocks: int) -> int:
        return -(-blocks * self.bytes_per_block // self.page_bytes)

    def info(self) -> dict[str, int]:
        return {
            "num_blocks": self.num_blocks,
            "usable_blocks": self.usable_blocks,
            "bytes_per_block": self.bytes_per_block,
            "page_bytes": self.page_bytes,
        }

    def resize(self, target_blocks: int) -> int:
        """Hold pages for ``target_blocks`` usable blocks; returns how many are usable now.

        Growing asks the broker for the missing pages (a refusal leaves fewer usable than
        asked, never an error); shrinking unmaps and gives back the pages beyond the target.
        """
        target = max(0, min(self.num_blocks, int(target_blocks)))
        with self._lock:
            before = self.granted_pages
            wanted = self.pages_for(target)
            if wanted > before:
                self.budget.ensure(wanted)
                self._map(before, self.granted_pages)
            elif wanted < before:
                self._give_back(wanted)
            return self.usable_blocks

    def close(self) -> None:
        with self._lock:
            self._give_back(0)

    def _map(self, first_page: int, end_page: int) -> None:
        if end_page > first_page:
            self.backing.map_pages(range(first_page, end_page))

    def _give_back(self, keep_pages: int) -> None:
        """Unmap, then return to the broker, every page from ``keep_pages`` on (exactly)."""
        surplus = self.granted_pages - keep_pages
        if surplus <= 0:
            return
        self.backing.unmap_pages(range(keep_pages, self.granted_pages))
        if self.budget.protected:
            try:
                self.budget.client.release(surplus)
            except BrokerError as exc:
                self.budget.failed("release", exc)
        self.budget.granted_pages = keep_pages


_lock = threading.Lock()
_current: WorkerKVPages | None = None


def open_pages(
    identity: WorkerIdentity, client: BrokerClient | None, backing: PhysicalBacking, kv_cache_config: Any
) -> WorkerKVPages:
    """Start elastic pages for a freshly allocated KV buffer (replacing any earlier one).

    ``client=None`` (the worker runs unprotected): the pages grant themselves, so EngineCore
    coordinates this worker like the others.  Raises :class:`~.kv_budget.KVCacheBudgetError`
    when not even the first page is granted.
    """
    global _current
    pages = WorkerKVPages(
        client,
        backing,
        num_blocks=int(kv_cache_config.num_blocks),
        bytes_per_block=kv_config.bytes_per_block(kv_cache_config),
        page_bytes=identity.page_bytes,
        identity=identity,
    )
    initial_blocks = max(1, min(pages.num_blocks, INITIAL_PAGES * pages.page_bytes // pages.bytes_per_block))
    if pages.resize(initial_blocks) < 1 and client is not None:
        room = worker.guard(identity, "status", lambda: kv_budget.measure_room(client))
        if room is not None:
            raise kv_budget.refusal(identity, room, pages.pages_for(1) * pages.page_bytes, "elastic KV pages")
    with _lock:
        previous, _current = _current, pages
    if previous is not None:
        previous.close()
    return pages


def current() -> WorkerKVPages | None:
    """This worker process's elastic pages, or None (a static, preallocated KV buffer)."""
    return _current


def forget() -> None:
    """Drop the elastic pages (tests; a worker tearing down its KV cache)."""
    global _current
    with _lock:
        previous, _current = _current, None
    if previous is not None:
        previous.close()
