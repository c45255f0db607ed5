"""SGLang's release/resume of memory occupation, followed through to the broker.

``release_memory_occupation`` (RL weight sync, a paused engine) pauses torch_memory_saver
regions by tag (``kv_cache``, ``weights``, ``cuda_graph``; no tags: all), and their physical
memory goes back to the device.  The charge for it would otherwise stay, so other instances
could never use that memory.  Hook points:

* ``SchedulerWeightUpdaterManager.release_memory_occupation`` / ``resume_memory_occupation``
  in ``sglang.srt.managers.scheduler_components.weight_updater`` (0.5.13+);
* the same two methods of ``SchedulerUpdateWeightsMixin`` in
  ``sglang.srt.managers.scheduler_update_weights_mixin`` (0.5.12).

With a memory saver that really releases (``memory_saver_adapter.enabled``), what each tag
held stops being charged once SGLang paused it, and is admitted back before SGLang maps it
again (:mod:`..handback`): the KV pools this process reported (DeepSeek-V4 pools,
``kv_static``) are suspended, and the runtime base, which holds the weights and CUDA graphs,
is pinned again at what the device measures.

Resume is an admission.  Every TP rank runs the same request, so the ranks min-reduce
whether all were admitted: one collective on every rank and on every path, protected or not,
whatever its broker did (a refusal, an eviction, ``BrokerRequired`` under
``KVCACHED_REQUIRE=1``).  If any rank failed, every rank hands back again what it was
admitted, and raises after the collective: the failed rank its own error (a refusal as
:class:`~.kv_budget.BrokerBudgetError` naming the broker and the room), the others a
``BrokerBudgetError`` saying another rank's broker refused.  SGLang never maps memory the
broker did not grant: a refused resume is an error, never an overbook.  Release never
raises before SGLang's own method has run (it has a TP barrier of its own).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...client import BudgetExceeded
from .. import announce, handback, sessions, worker_identity
from ..patching import wrap_methods, wrap_once
from . import kv_budget, reporting, parallel

log = announce.logger("kvcached_broker.adapters.sglang")

#: SGLang's memory tags (``GPU_MEMORY_ALL_TYPES``), what a request without tags means
ALL_TAGS = frozenset({"kv_cache", "weights", "cuda_graph"})


def requested_tags(recv_req: Any) -> set[str]:
    """The tags a release or resume request names (none: all of them)."""
    tags = getattr(recv_req, "tags", None)
    return set(tags) if tags else set(ALL_TAGS)


def releases_memory(owner: Any) -> bool:
    """True if SGLang's memory saver really releases (and maps again) what it pauses."""
    saver = getattr(owner, "memory_saver_adapter", None)
    return bool(getattr(saver, "enabled", False))


def _workers() -> list[tuple[worker_identity.WorkerIdentity, list[str]]]:
    """``(identity, KV reporter keys)`` for each device this process has a session on."""
    kv = {str(identity.device): keys for identity, keys in reporting.kv_reporters_by_device()}
    return [(identity, kv.get(str(identity.device), [])) for identity in sessions.open_identities()]


def _attempt(step: Callable[[], None]) -> Exception | None:
    """Run ``step``; the exception it raised, to raise once the ranks have agreed."""
    try:
        step()
    except Exception as exc:  # noqa: BLE001 - every rank must reach the collective
        return exc
    return None


# ------------------------------------------------------------------------------ release
def before_release(tags: set[str]) -> None:
    for identity, _ in _workers():
        handback.before_release(identity, tags)


def after_release(tags: set[str]) -> None:
    for identity, kv_names in _workers():
        handback.after_release(identity, tags, kv_names)


def wrap_release(original: Callable[..., Any]) -> Callable[..., Any]:
    def release_memory_occupation(self: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
        if not releases_memory(self):
            return original(self, recv_req, *args, **kwargs)
        tags = requested_tags(recv_req)
        failure = _attempt(lambda: before_release(tags))
        result = original(self, recv_req, *args, **kwargs)
        if failure is not None:
            raise failure
        after_release(tags)
        return result

    return wrap_once(original, release_memory_occupation)


# ------------------------------------------------------------------------------- resume
def admit(tags: set[str]) -> None:
    """Charge again what ``tags`` bring back, on every device; a refusal is explained."""
    for identity, kv_names in _workers():
        try:
            handback.admit(identity, tags, kv_names)
        except BudgetExceeded as exc:
            session = sessions.session(identity)
            if session is None:
                raise
            needed_bytes = handback.coming_back_bytes(identity, tags, kv_names)
            raise kv_budget.explain_refusal(identity, session.client, needed_bytes, "its memory back", exc) from exc


def roll_back() -> None:
    for identity, _ in _workers():
        handback.roll_back(identity)


def settle(tags: set[str]) -> None:
    for identity, _ in _workers():
        handback.settle(identity, tags)


def wrap_resume(original: Callable[..., Any]) -> Callable[..., Any]:
    def resume_memory_occupation(self: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
        if not releases_memory(self):
            return original(self, recv_req, *args, **kwargs)
        tags = requested_tags(recv_req)
        failure = _attempt(lambda: admit(tags))
        if parallel.tp_group().reduce_min(int(failure is None)) == 0:  # every rank, once, on every path
            undo_failure = _attempt(roll_back)
            if undo_failure is not None:
                log.warning("event=sglang_resume_roll_back_failed reason=%r", str(undo_failure))
            raise failure or kv_budget.BrokerBudgetError(
                "another TP rank's kvcached-broker refused to take its memory back; no rank resumed")
        try:
            result = original(self, recv_req, *args, **kwargs)
        except BaseException:
            roll_back()  # SGLang mapped nothing it was admitted for
            raise
        settle(tags)
        return result

    return wrap_once(original, resume_memory_occupation)


def _apply(module: Any, class_name: str) -> None:
    wrap_methods(module, class_name, {"release_memory_occupation": wrap_release, "resume_memory_occupation": wrap_resume})


def apply_weight_updater(module: Any) -> None:
    """``SchedulerWeightUpdaterManager`` in ``scheduler_components.weight_updater`` (0.5.13+)."""
    _apply(module, "SchedulerWeightUpdaterManager")


def apply_update_weights_mixin(module: Any) -> None:
    """``SchedulerUpdateWeightsMixin`` in ``managers.scheduler_update_weights_mixin`` (0.5.12)."""
    _apply(module, "SchedulerUpdateWeightsMixin")
