"""vLLM's sleep mode, followed through to the broker: memory a sleeping worker handed back is not charged.

``Worker.sleep(level)`` frees the KV cache and the weights at every level (level 1 offloads
the weights to host memory, level 2 discards them); ``Worker.discard(tags)`` (0.33+) frees
the tagged memory alone.  ``wake_up(tags)`` maps it again (no tags: all).  What the broker
charges follows (:mod:`..handback`): the KV reporter is suspended, and the runtime base,
which holds the weights, is pinned again at what the device measures.  Hook points:

* ``Worker.sleep`` and ``Worker.discard`` in ``vllm.v1.worker.gpu_worker``: the base is
  pinned at what the device measures just before, and again after vLLM freed the memory,
  with the KV reporter suspended in the same request;
* ``Worker.wake_up``: what the tags bring back (the KV cache, the base the weights held) is
  admitted *before* vLLM maps the memory again, and the base is pinned at what the device
  measures after; a refusal raises :class:`~.kv_budget.KVCacheBudgetError`, and nothing is
  mapped;
* ``Executor.wake_up`` in ``vllm.v1.executor.abstract`` (EngineCore's side): before any
  worker wakes, every worker is asked (one ``collective_rpc``) to admit what it takes back;
  if one fails (a refusal, an eviction, ``BrokerRequired``), the others hand theirs back
  again and the wake fails with that worker's reason, so no TP rank wakes up alone.  vLLM
  reports the failed utility call to its caller.

No collective runs inside a worker.  Elastic pages are left alone (a sleeping worker keeps
its grant).
"""

from __future__ import annotations

from typing import Any, Callable

from ...client import BudgetExceeded
from .. import announce, handback, process_state, sessions, worker_identity
from ..patching import wrap_methods, wrap_once
from . import kv_budget, parallel

log = announce.logger("kvcached_broker.adapters.vllm")

#: What ``Worker.sleep`` frees at every level, and what a wake without tags maps again
SLEEP_TAGS = frozenset({"weights", "kv_cache"})


class _Asleep:
    """The workers of this process that handed memory back and have not taken all of it back:
    device -> the identity that handed it back."""

    def __init__(self) -> None:
        self.by_device: dict[str, worker_identity.WorkerIdentity] = {}


def wake_tags(tags: list[str] | None) -> set[str]:
    return set(tags) if tags else set(SLEEP_TAGS)


def before_release(identity: worker_identity.WorkerIdentity, tags: set[str]) -> Exception | None:
    """Pin the base before vLLM frees ``tags``; the failure to raise once vLLM has freed them."""
    try:
        handback.before_release(identity, tags)
    except Exception as exc:  # noqa: BLE001 - vLLM's own release runs first
        return exc
    return None


def after_release(identity: worker_identity.WorkerIdentity, tags: set[str]) -> int:
    """Stop charging what vLLM freed; returns the bytes no longer charged."""
    freed = handback.after_release(identity, tags, [kv_budget.REPORTER])
    if handback.handed_back(identity):
        process_state.part(_Asleep).by_device[str(identity.device)] = identity
    log.info("event=vllm_memory_released rank=%d tags=%s bytes=%d", identity.tp_rank, ",".join(sorted(tags)), freed)
    return freed


def admit(identity: worker_identity.WorkerIdentity, tags: set[str]) -> None:
    """Charge again what ``tags`` bring back; :class:`KVCacheBudgetError` if the broker has no room."""
    try:
        handback.admit(identity, tags, [kv_budget.REPORTER])
    except BudgetExceeded as exc:
        session = sessions.session(identity)
        if session is None:
            raise
        asked_bytes = handback.coming_back_bytes(identity, tags, [kv_budget.REPORTER])
        raise kv_budget.explain(identity, session.client, asked_bytes, "its memory back to wake up", exc) from exc


def settle(identity: worker_identity.WorkerIdentity, tags: set[str]) -> None:
    handback.settle(identity, tags)
    if not handback.handed_back(identity):
        process_state.part(_Asleep).by_device.pop(str(identity.device), None)


# ------------------------------------------------------------------------ worker side
def _followed(device: Any, tags: set[str], free: Callable[[], None]) -> None:
    """vLLM frees ``tags`` (``free``), with the base pinned before and the charge dropped after;
    a failure to pin is raised only once vLLM's own release has run."""
    identity = parallel.identity(device)
    failure = before_release(identity, tags)
    free()
    if failure is not None:
        raise failure
    after_release(identity, tags)


def wrap_sleep(original: Callable[..., None]) -> Callable[..., None]:
    def sleep(self: Any, level: int = 1, *args: Any, **kwargs: Any) -> None:
        _followed(self.device, set(SLEEP_TAGS), lambda: original(self, level, *args, **kwargs))

    return wrap_once(original, sleep)


def wrap_discard(original: Callable[..., None]) -> Callable[..., None]:
    def discard(self: Any, tags: tuple[str, ...], *args: Any, **kwargs: Any) -> None:
        _followed(self.device, set(tags), lambda: original(self, tags, *args, **kwargs))

    return wrap_once(original, discard)


def wrap_wake_up(original: Callable[..., Any]) -> Callable[..., Any]:
    def wake_up(self: Any, tags: list[str] | None = None, *args: Any, **kwargs: Any) -> Any:
        identity = parallel.identity(self.device)
        admit(identity, wake_tags(tags))  # before vLLM maps the memory again
        try:
            result = original(self, tags, *args, **kwargs)
        except BaseException:
            handback.roll_back(identity)  # vLLM mapped nothing it was admitted for
            raise
        settle(identity, wake_tags(tags))
        return result

    return wrap_once(original, wake_up)


def apply_gpu_worker(module: Any) -> None:
    """``Worker.sleep``, ``Worker.wake_up`` and, where vLLM has it (0.33+), ``Worker.discard``
    in ``vllm.v1.worker.gpu_worker``."""
    wrappers = {"sleep": wrap_sleep, "wake_up": wrap_wake_up}
    if "discard" in vars(getattr(module, "Worker", object)):
        wrappers["discard"] = wrap_discard
    wrap_methods(module, "Worker", wrappers)


# ---------------------------------------------------------------------- EngineCore side
def on_worker(_worker: Any, action: str, tags: list[str] | None = None) -> str | None:
    """What ``collective_rpc`` runs in each worker: ``admit`` what ``tags`` bring back, or
    ``roll_back`` (hand it back again).  None, or why this worker could not."""
    wanted = wake_tags(tags)
    for identity in list(process_state.part(_Asleep).by_device.values()):
        try:
            if action == "roll_back":
                handback.roll_back(identity)
            else:
                admit(identity, wanted)
        except Exception as exc:  # noqa: BLE001 - the reason goes back to EngineCore, which decides
            return str(exc) if isinstance(exc, kv_budget.KVCacheBudgetError) else f"{type(exc).__name__}: {exc}"
    return None


def wrap_executor_wake_up(original: Callable[..., Any]) -> Callable[..., Any]:
    def wake_up(self: Any, tags: list[str] | None = None, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "is_sleeping", False):
            failed = [reason for reason in self.collective_rpc(on_worker, args=("admit", tags)) if reason]
            if failed:
                self.collective_rpc(on_worker, args=("roll_back", tags))  # no rank wakes up alone
                raise kv_budget.KVCacheBudgetError(failed[0])
        return original(self, tags, *args, **kwargs)

    return wrap_once(original, wake_up)


def apply_executor(module: Any) -> None:
    """``Executor.wake_up`` in ``vllm.v1.executor.abstract``."""
    wrap_methods(module, "Executor", {"wake_up": wrap_executor_wake_up})


def reset() -> None:
    """Forget which workers handed memory back (tests)."""
    process_state.forget(_Asleep)
