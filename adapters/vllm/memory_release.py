"""vLLM's sleep mode, followed through to the broker: a sleeping worker's KV cache is not charged.

``Worker.sleep(level)`` discards the KV cache at every level (level 1 also offloads the
weights, level 2 discards them), so its memory goes back to the device; the worker's
``kv_static`` charge would otherwise stay.  Hook points, both releases:

* ``Worker.sleep`` in ``vllm.v1.worker.gpu_worker``: after vLLM freed the memory, the KV
  reporter is suspended (its bytes are no longer charged, the book keeps them);
* ``Worker.wake_up``: with the ``kv_cache`` tag (or no tags), the KV reporter is admitted
  back *before* vLLM maps the memory again; a refusal raises
  :class:`~.kv_budget.KVCacheBudgetError`, and nothing is mapped;
* ``Executor.wake_up`` in ``vllm.v1.executor.abstract`` (EngineCore's side): before any
  worker wakes, every worker is asked (one ``collective_rpc``) to admit its KV cache; if one
  is refused, the others suspend theirs again and the wake fails with that worker's
  reason, so no TP rank wakes up alone.  vLLM reports the failed utility call to its caller.

Weights are not reported by this adapter, so their tags change nothing here.  Elastic
workers (an on-demand backing) hold pages, not a ``kv_static`` charge, and are left alone.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ...client import BudgetExceeded
from ...client.units import format_bytes
from .. import worker
from ..patching import wrap_methods, wrap_once
from . import kv_budget, parallel

log = logging.getLogger("kvcached_broker.adapters.vllm")

KV_CACHE_TAG = "kv_cache"
_asleep: dict[str, worker.WorkerIdentity] = {}  # device -> the identity whose KV is suspended


def wakes_kv(tags: list[str] | None) -> bool:
    return not tags or KV_CACHE_TAG in tags


def fall_asleep(identity: worker.WorkerIdentity) -> int:
    """Stop charging this worker's KV cache; returns the bytes no longer charged."""
    freed = worker.suspend(identity, [kv_budget.REPORTER])
    if freed:
        _asleep[str(identity.device)] = identity
        log.info("event=vllm_kv_asleep rank=%d bytes=%s", identity.tp_rank, format_bytes(freed))
    return freed


def admit(identity: worker.WorkerIdentity) -> None:
    """Charge this worker's KV cache again; :class:`KVCacheBudgetError` if the broker has no room."""
    held = worker.booked_bytes(identity, kv_budget.REPORTER)
    try:
        worker.resume(identity, [kv_budget.REPORTER])
    except BudgetExceeded as exc:
        client = worker.session(identity)
        if client is None:
            raise
        raise kv_budget.explain(identity, client, held, "the KV cache back to wake up", exc) from exc
    _asleep.pop(str(identity.device), None)


# ------------------------------------------------------------------------ worker side
def wrap_sleep(original: Callable[..., None]) -> Callable[..., None]:
    def sleep(self: Any, level: int = 1, *args: Any, **kwargs: Any) -> None:
        original(self, level, *args, **kwargs)
        fall_asleep(parallel.identity(self.device))

    return wrap_once(original, sleep)


def wrap_wake_up(original: Callable[..., None]) -> Callable[..., None]:
    def wake_up(self: Any, tags: list[str] | None = None, *args: Any, **kwargs: Any) -> None:
        if wakes_kv(tags):
            admit(parallel.identity(self.device))  # before vLLM maps the memory again
        return original(self, tags, *args, **kwargs)

    return wrap_once(original, wake_up)


def apply_gpu_worker(module: Any) -> None:
    """``Worker.sleep`` and ``Worker.wake_up`` in ``vllm.v1.worker.gpu_worker``."""
    wrap_methods(module, "Worker", {"sleep": wrap_sleep, "wake_up": wrap_wake_up})


# ---------------------------------------------------------------------- EngineCore side
def on_worker(_worker: Any, action: str) -> str | None:
    """What ``collective_rpc`` runs in each worker: ``admit`` (None or why not) or ``suspend``."""
    for identity in list(_asleep.values()):
        if action == "suspend":
            fall_asleep(identity)
            continue
        try:
            admit(identity)
        except kv_budget.KVCacheBudgetError as exc:
            return str(exc)
    return None


def wrap_executor_wake_up(original: Callable[..., Any]) -> Callable[..., Any]:
    def wake_up(self: Any, tags: list[str] | None = None, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "is_sleeping", False) and wakes_kv(tags):
            refused = [reason for reason in self.collective_rpc(on_worker, args=("admit",)) if reason]
            if refused:
                self.collective_rpc(on_worker, args=("suspend",))  # no rank wakes up alone
                raise kv_budget.KVCacheBudgetError(refused[0])
        return original(self, tags, *args, **kwargs)

    return wrap_once(original, wake_up)


def apply_executor(module: Any) -> None:
    """``Executor.wake_up`` in ``vllm.v1.executor.abstract``."""
    wrap_methods(module, "Executor", {"wake_up": wrap_executor_wake_up})


def reset() -> None:
    """Forget which workers sleep (tests)."""
    _asleep.clear()
