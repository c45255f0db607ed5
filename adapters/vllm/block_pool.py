"""A broker-gated vLLM ``BlockPool``: blocks beyond the granted ones are held back.

vLLM's scheduler (in EngineCore) draws every cache group's blocks from one ``BlockPool``.
An :class:`ElasticBlockGate` attached to it keeps block ids ``[1, limit)`` usable (0 is
vLLM's null block) and holds back ``[limit, num_gpu_blocks)``: out of the free queue, with
no prefix-cache hash, never handed out.  Before the pool would run short it asks the
workers (a :class:`WorkerGroup`, see :mod:`.engine`) to get pages from their brokers, and
releases the new blocks only for the count every worker agreed on.  When many blocks sit
free it holds the top ones back again and lets the workers hand the pages back.

Hysteresis, in blocks: grow by at least ``batch_blocks``; trim only when more than
``2 * batch_blocks`` are free, down to ``batch_blocks`` free.  After a refusal the gate
does not ask again for ``refusal_backoff_s``.

Invariant: every worker holds pages for at least ``limit`` blocks (``usable_blocks``
plus the null block), so no block the scheduler can hand out lacks backing, and the
broker's budget is never overbooked.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Protocol

from ..patching import wrap_methods, wrap_once

log = logging.getLogger("kvcached_broker.adapters.vllm")

GATE_ATTR = "_kvcached_broker_gate"


class WorkerGroup(Protocol):
    def resize(self, target_blocks: int, floor_blocks: int = 0) -> int:
        """Ask every worker to back ``target_blocks`` blocks (keeping at least ``floor_blocks``);
        returns the count they all back."""


class ElasticBlockGate:
    """The gate on one ``BlockPool``: ids ``[1, limit)`` usable, ``[limit, num_gpu_blocks)`` held back."""

    def __init__(
        self,
        pool: Any,
        workers: WorkerGroup,
        *,
        batch_blocks: int,
        backed_blocks: int,
        refusal_backoff_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
    ):
        if batch_blocks < 1:
            raise ValueError("batch_blocks must be >= 1")
        self.pool = pool
        self.workers = workers
        self.batch_blocks = batch_blocks
        self.refusal_backoff_s = refusal_backoff_s
        self.clock = clock
        self.limit = int(pool.num_gpu_blocks)
        self.refusals = 0
        self._quiet_until = 0.0
        self._hold_back(max(1, min(self.limit, backed_blocks)))

    # ------------------------------------------------------------------ views
    @property
    def usable_blocks(self) -> int:
        return self.limit - 1

    @property
    def held_back_blocks(self) -> int:
        return int(self.pool.num_gpu_blocks) - self.limit

    def free_blocks(self) -> int:
        return int(self.pool.free_block_queue.num_free_blocks)

    def usage(self) -> float:
        """Share of the usable blocks in use (vLLM's ``get_usage`` over the granted pool)."""
        return 1.0 - self.free_blocks() / self.usable_blocks if self.usable_blocks else 0.0

    def can_grow(self) -> bool:
        return self.held_back_blocks > 0 and self.clock() >= self._quiet_until

    # ----------------------------------------------------------------- growth
    def grow(self, extra_blocks: int) -> int:
        """Make ``extra_blocks`` more usable (asking for at least a batch); returns how many were added.

        Adds fewer, possibly none, when a broker refuses: the caller sees a scheduling miss.
        """
        if not self.can_grow():
            return 0
        before, total = self.limit, int(self.pool.num_gpu_blocks)
        target = min(total, before + max(int(extra_blocks), self.batch_blocks))
        agreed = min(target, int(self.workers.resize(target, floor_blocks=before)))
        if agreed > before:
            self._release_up_to(agreed)
        elif agreed < before:
            log.warning("event=vllm_elastic_backing_lost limit_blocks=%d backed_blocks=%d", before, agreed)
        if agreed < min(total, before + int(extra_blocks)):
            self.refusals += 1
            self._quiet_until = self.clock() + self.refusal_backoff_s
            log.info("event=vllm_elastic_refused wanted_blocks=%d added_blocks=%d", extra_blocks, max(0, agreed - before))
        return max(0, agreed - before)

    def top_up(self) -> None:
        """Grow ahead of need when fewer than half a batch of blocks is free."""
        if self.free_blocks() * 2 < self.batch_blocks and self.can_grow():
            self.grow(self.batch_blocks)

    def _release_up_to(self, new_limit: int) -> None:
        released = self.pool.blocks[self.limit : new_limit]
        self.limit = new_limit
        self.pool.free_block_queue.append_n(released)

    # ----------------------------------------------------------------- trimming
    def maybe_trim(self) -> int:
        """Hold back the top free blocks when more than two batches are free; returns how many."""
        free = self.free_blocks()
        if free <= 2 * self.batch_blocks:
            return 0
        new_limit = self._lowest_free_suffix(max_blocks=free - self.batch_blocks)
        if new_limit >= self.limit:
            return 0
        taken = self.limit - new_limit
        self._hold_back(new_limit)
        self.workers.resize(self.limit, floor_blocks=self.limit)
        return taken

    def _lowest_free_suffix(self, max_blocks: int) -> int:
        """The lowest id L >= limit - max_blocks such that every block in [L, limit) is idle."""
        floor = max(1, self.limit - max_blocks)
        new_limit = self.limit
        while new_limit > floor and self._idle(self.pool.blocks[new_limit - 1]):
            new_limit -= 1
        return new_limit

    def _idle(self, block: Any) -> bool:
        watchers = getattr(self.pool, "_reuse_watchers", None) or {}
        return block.ref_cnt == 0 and not block.is_null and block.block_id not in watchers

    def _hold_back(self, new_limit: int) -> None:
        """Take blocks ``[new_limit, limit)`` out of the free queue and the prefix cache."""
        queue = self.pool.free_block_queue
        taken = self.pool.blocks[new_limit : self.limit]
        for block in taken:
            if block.block_hash is not None:
                self.pool.evict_blocks({block.block_id})
            queue.remove(block)
        self.limit = new_limit

    # ------------------------------------------------------------ prefix reset
    def reset_prefix_cache(self, original: Callable[[Any], bool]) -> bool:
        """vLLM's reset, with the held-back blocks counted as free for its duration."""
        held_from = self.limit
        self._release_up_to(int(self.pool.num_gpu_blocks))
        try:
            return original(self.pool)
        finally:
            self._hold_back(held_from)


def gate_of(pool: Any) -> ElasticBlockGate | None:
    return getattr(pool, GATE_ATTR, None) if pool is not None else None


def attach(pool: Any, workers: WorkerGroup, *, batch_blocks: int, backed_blocks: int, **options: Any) -> ElasticBlockGate:
    """Gate ``pool`` (a fresh vLLM ``BlockPool``) to the blocks ``workers`` back."""
    if gate_of(pool) is not None:
        raise ValueError("this BlockPool is already gated")
    gate = ElasticBlockGate(pool, workers, batch_blocks=batch_blocks, backed_blocks=backed_blocks, **options)
    setattr(pool, GATE_ATTR, gate)
    return gate


# ---------------------------------------------------------------- class patches
def _gated(original: Callable[..., Any], gated: Callable[..., Any]) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        gate = self.__dict__.get(GATE_ATTR)
        if gate is None:
            return original(self, *args, **kwargs)
        return gated(gate, original, self, *args, **kwargs)

    return wrap_once(original, method)


def _get_num_free_blocks(gate: ElasticBlockGate, original: Callable[..., int], pool: Any) -> int:
    gate.top_up()
    return original(pool)


def _get_new_blocks(gate: ElasticBlockGate, original: Callable[..., Any], pool: Any, num_blocks: int) -> Any:
    short = num_blocks - gate.free_blocks()
    if short > 0:
        gate.grow(short)
    return original(pool, num_blocks)


def _free_blocks(gate: ElasticBlockGate, original: Callable[..., Any], pool: Any, ordered_blocks: Any) -> None:
    original(pool, ordered_blocks)
    gate.maybe_trim()


def _get_usage(gate: ElasticBlockGate, original: Callable[..., float], pool: Any) -> float:
    return gate.usage()


def _reset_prefix_cache(gate: ElasticBlockGate, original: Callable[..., bool], pool: Any) -> bool:
    return gate.reset_prefix_cache(original)


_GATED_METHODS = {
    "get_num_free_blocks": _get_num_free_blocks,
    "get_new_blocks": _get_new_blocks,
    "free_blocks": _free_blocks,
    "get_usage": _get_usage,
    "reset_prefix_cache": _reset_prefix_cache,
}


def apply_block_pool(module: Any) -> None:
    """Route ``vllm.v1.core.block_pool.BlockPool``'s allocation methods through a gate, if any."""
    wrap_methods(module, "BlockPool", {
        name: (lambda original, gated=gated: _gated(original, gated)) for name, gated in _GATED_METHODS.items()
    })
