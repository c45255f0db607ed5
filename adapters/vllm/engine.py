"""EngineCore coordinates the elastic KV cache; each GPU worker talks to its own broker.

The decision, and why:

* The memory lives in the worker processes, so the worker's own session is what gets
  charged.  The broker checks that a session's device UUID is its GPU's, watches the
  session's pid to reclaim a dead worker's pages, and charges a process what NVML sees it
  use (``max(reported, measured)``).  Pages held by an EngineCore session would be charged
  to a process that holds no device memory, escape the pid watch of the process that does,
  and be counted again as the worker's unreported use.
* The ``BlockPool`` lives in EngineCore, so EngineCore decides how many blocks are usable.
  It asks every worker (one ``collective_rpc``) to back a target count; each worker asks its
  own broker through its client's credit reserve; EngineCore takes the minimum over the
  replies (all TP and PP ranks) and, only if they differ, asks the richer workers to give
  back the surplus.  No collective runs inside a worker, so a failing rank cannot hang the
  group, and the one agreement point is the process that owns the blocks.
* RPCs to the workers queue behind the step in flight, so pages are unmapped only after
  every step that could still read those blocks has finished.

Elastic mode needs an on-demand backing in the workers (:mod:`kvcached_broker.adapters.backing`);
with vLLM's normal preallocated buffer the workers report it as ``kv_static`` and the pool
stays ungated.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from .. import worker
from ..patching import wrap_methods, wrap_once
from . import block_pool, worker_pages

log = logging.getLogger("kvcached_broker.adapters.vllm")

#: grow at least this many broker pages' worth of blocks at a time
BATCH_PAGES = 16


#: ``call(method, args)`` runs ``WorkerKVPages.<method>(*args)`` on every worker; one reply each
Call = Callable[[str, tuple], Sequence[Any]]


class Workers:
    """Every GPU worker of one engine, seen from EngineCore (a :class:`block_pool.WorkerGroup`)."""

    def __init__(self, call: Call):
        self.call = call

    def infos(self) -> list[dict[str, int] | None]:
        return list(self.call("info", ()))

    def resize(self, target_blocks: int, floor_blocks: int = 0) -> int:
        """Every worker backs ``target_blocks``; returns the count they all back.

        Workers that got more than the poorest give the surplus back, but never below
        ``floor_blocks`` (the blocks the scheduler may already have handed out).
        """
        replies = [int(r) for r in self.call("resize", (int(target_blocks),))]
        agreed = min(replies)
        settle = max(agreed, int(floor_blocks))
        if max(replies) > settle:
            self.call("resize", (settle,))
        return agreed


def on_worker(_worker: Any, method: str, *args: Any) -> Any:
    """What ``collective_rpc`` runs in each worker: the method of its elastic pages."""
    pages = worker_pages.current()
    if pages is None:
        return None
    return getattr(pages, method)(*args)


def executor_call(executor: Any) -> Call:
    return lambda method, args: executor.collective_rpc(on_worker, args=(method, *args))


def attach_workers(pool: Any, workers: Workers, *, batch_pages: int = BATCH_PAGES, **options: Any):
    """Gate ``pool`` when every worker runs elastic pages; None (ungated) otherwise."""
    infos = workers.infos()
    if not infos or any(info is None for info in infos):
        return None
    bytes_per_block = max(info["bytes_per_block"] for info in infos)
    page_bytes = min(info["page_bytes"] for info in infos)
    batch_blocks = max(1, batch_pages * page_bytes // bytes_per_block)
    backed = workers.resize(min(info["usable_blocks"] for info in infos))
    gate = block_pool.attach(pool, workers, batch_blocks=batch_blocks, backed_blocks=backed, **options)
    log.info(
        "event=vllm_elastic_attached workers=%d blocks=%d usable_blocks=%d batch_blocks=%d",
        len(infos), pool.num_gpu_blocks, gate.usable_blocks, batch_blocks,
    )
    return gate


def attach_engine(engine_core: Any):
    """Gate the scheduler's GPU block pool of a freshly built EngineCore, if elastic."""
    manager = getattr(getattr(engine_core, "scheduler", None), "kv_cache_manager", None)
    pool = getattr(manager, "block_pool", None)
    executor = getattr(engine_core, "model_executor", None)
    if pool is None or executor is None:
        log.info("event=vllm_elastic_skipped reason=no_scheduler_block_pool")
        return None
    return attach_workers(pool, Workers(executor_call(executor)))


def wrap_engine_init(original: Callable[..., None]) -> Callable[..., None]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        gate = attach_engine(self)
        worker.announce_process("vllm", "engine_core" if gate is None else "engine_core_elastic")

    return wrap_once(original, __init__)


def apply_engine_core(module: Any) -> None:
    wrap_methods(module, "EngineCore", {"__init__": wrap_engine_init})
