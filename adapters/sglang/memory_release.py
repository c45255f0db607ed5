"""SGLang's release/resume of memory occupation, followed through to the broker.

``release_memory_occupation`` (RL weight sync, a paused engine) pauses the KV cache's
torch_memory_saver region: its physical memory goes back to the device.  The charge for it
would otherwise stay, so other instances could never use that memory.  Hook points:

* ``SchedulerWeightUpdaterManager.release_memory_occupation`` / ``resume_memory_occupation``
  in ``sglang.srt.managers.scheduler_components.weight_updater`` (0.5.13+);
* the same two methods of ``SchedulerUpdateWeightsMixin`` in
  ``sglang.srt.managers.scheduler_update_weights_mixin`` (0.5.12).

Release, with the ``kv_cache`` tag (or no tags: all of them) and a memory saver that really
releases (``memory_saver_adapter.enabled``): after SGLang paused the region, every KV pool
this process reported (DeepSeek-V4 pools, ``kv_static``) is suspended, so it is no longer
charged.  Resume: before SGLang maps the region again, those pools are admitted back.  Every
TP rank runs the same request, so the ranks min-reduce whether all were admitted (one
collective on every rank, protected or not); if any was refused, every rank suspends again
and raises :class:`~.budget.BrokerBudgetError` naming the broker and the room, and SGLang
never maps memory the broker did not grant: a refused resume is an error, never an overbook.
Weights and CUDA graphs are not reported by this adapter, so their tags change nothing here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ...client import BudgetExceeded
from ...client.units import format_bytes
from .. import worker
from ..patching import wrap_methods, wrap_once
from . import kv_budget, reporting, parallel

log = logging.getLogger("kvcached_broker.adapters.sglang")

KV_CACHE_TAG = "kv_cache"
_METHODS = ("release_memory_occupation", "resume_memory_occupation")


def releases_kv(owner: Any, recv_req: Any) -> bool:
    """True if this request pauses (or resumes) KV memory for real."""
    tags = getattr(recv_req, "tags", None)
    saver = getattr(owner, "memory_saver_adapter", None)
    return (not tags or KV_CACHE_TAG in tags) and bool(getattr(saver, "enabled", False))


def suspend_kv() -> int:
    """Stop charging this process's KV pools; returns the bytes no longer charged."""
    freed = 0
    for identity, keys in reporting.kv_reporters_by_device():
        freed += worker.suspend(identity, keys)
    if freed:
        log.info("event=sglang_kv_released bytes=%s", format_bytes(freed))
    return freed


def admit_kv() -> tuple[bool, str]:
    """Charge the suspended KV pools again; ``(admitted, why not)``."""
    for identity, keys in reporting.kv_reporters_by_device():
        try:
            worker.resume(identity, keys)
        except BudgetExceeded as exc:
            client = worker.session(identity)
            error = kv_budget.explain_refusal(identity, client, _suspended_bytes(identity), "its KV cache back", exc) \
                if client is not None else exc
            return False, str(error)
    return True, ""


def _suspended_bytes(identity: worker.WorkerIdentity) -> int:
    return reporting.totals_of(worker.suspended(identity))


def wrap_release(original: Callable[..., Any]) -> Callable[..., Any]:
    def release_memory_occupation(self: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, recv_req, *args, **kwargs)
        if releases_kv(self, recv_req):
            suspend_kv()
        return result

    return wrap_once(original, release_memory_occupation)


def wrap_resume(original: Callable[..., Any]) -> Callable[..., Any]:
    def resume_memory_occupation(self: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
        if releases_kv(self, recv_req):
            admitted, why = admit_kv()
            if parallel.tp_group().reduce_min(int(admitted)) == 0:  # every rank, once
                suspend_kv()  # the ranks that were admitted give it back
                raise kv_budget.BrokerBudgetError(why or "another TP rank's broker refused to resume its KV cache")
        return original(self, recv_req, *args, **kwargs)

    return wrap_once(original, resume_memory_occupation)


def _apply(module: Any, class_name: str) -> None:
    wrap_methods(module, class_name, {"release_memory_occupation": wrap_release, "resume_memory_occupation": wrap_resume})


def apply_weight_updater(module: Any) -> None:
    """``SchedulerWeightUpdaterManager`` in ``scheduler_components.weight_updater`` (0.5.13+)."""
    _apply(module, "SchedulerWeightUpdaterManager")


def apply_update_weights_mixin(module: Any) -> None:
    """``SchedulerUpdateWeightsMixin`` in ``managers.scheduler_update_weights_mixin`` (0.5.12)."""
    _apply(module, "SchedulerUpdateWeightsMixin")
