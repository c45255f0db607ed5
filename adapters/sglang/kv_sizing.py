"""Size SGLang's KV cache by what this GPU's broker can grant, and charge what gets built.

SGLang decides its KV capacity from ``_profile_available_bytes(pre_model_load_memory)``: the
free device memory after loading weights, less its *slack*, ``pre_model_load_memory x (1 -
mem_fraction_static)``, which it keeps for activations and CUDA graphs and allocates after
the pools.  Two co-located models both see the same free memory.  This module patches, on
``KVCacheConfigurator`` (0.5.16+) or ``ModelRunnerKVCacheMixin`` (0.5.12-0.5.15):

* ``_profile_available_bytes``: the whole start-up is admitted in one broker request
  (:func:`..sizing.size`): the runtime base pinned, the slack held in full
  (``runtime_slack_hold``), and the KV cache held at most at SGLang's figure, as much as fits
  (``kv_sizing_hold``), so no other instance can take any of it before SGLang allocates it;
  then the figure is min-reduced over SGLang's world group so every rank sizes alike.  Not
  even the slack fitting is a startup error naming the broker, the ask, the room and who
  holds it.
* ``_resolve_memory_pool_config``: if the capped budget is too small for the runtime to
  build a pool, its failure is re-raised with that same broker context.
* ``_init_pools``: once the pools exist, a DeepSeek-V4 pool is measured again per pool
  (``dsv4_reservation``); any other pool is charged as one ``kv_static`` reservation
  (unless it is broker-managed, i.e. elastic), less any storage another reporter already
  charged (a fused draft pool is a view of the target's unified buffer).  Each such report
  shrinks the hold in the same broker request; a pool larger than the hold (SGLang floors its
  tokens to the page size, then allocates ``size + page_size`` rows) takes the rest out of
  the slack hold, as it does in SGLang's own arithmetic.  The KV hold is dropped with the last
  pools of the start-up: at the end of the scheduler's model-worker start-up (``startup``,
  which also ends the warm-up: CUDA graphs are captured by then), or, outside it, with the
  target's pools when no draft follows and with the draft's otherwise (``speculative``).

In kvcached mode (kvcached's capacity patch under this one, ``kvcached_sizing``; that patch is
patched too, :func:`apply_kvcached_patches`, to put this cap back outside it) the figure is
kvcached's *virtual* budget (``total_memory x mem_fraction_static``, MIN-reduced over the world
group by kvcached itself): kvcached maps nothing at sizing time, and its pools take their
memory page by page from the broker later (``adapters/kvcached``).  So the figure is capped at
what the broker could *ever* give the instance (the answer's ``ever_bytes``), no KV hold is
taken (the slack still is), and every rank still takes part in the same world min-reduce.  A pool kvcached does
not manage (DeepSeek-V4: ``kvcached_fallback``) is static, and sized as above, with a hold.
All sizes are bytes.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...client.units import format_bytes
from .. import announce, process_state, sessions, sizing, worker_identity
from ..patching import wrap_methods, wrap_once
from . import (dsv4_reservation, kv_budget, kvcached_fallback, kvcached_sizing, kvcached_sync, parallel, pool_bytes,
               reporting, speculative, startup)

log = announce.logger("kvcached_broker.adapters.sglang")


@dataclass(frozen=True)
class SizingDecision:
    runtime_bytes: int  # what SGLang's own profile said
    capped_bytes: int  # what it was given
    sized: sizing.Sized | None  # what the broker admitted (None: unprotected)
    endpoint: str = ""

    @property
    def lowered(self) -> bool:
        return self.capped_bytes < self.runtime_bytes


class _Decisions:
    """Per thread: the sizing decision it made last (``last.decision``, unset before its first)."""

    def __init__(self) -> None:
        self.last = threading.local()


def last_decision() -> SizingDecision | None:
    """The sizing decision this thread made last (tests, and the config-failure message)."""
    return getattr(process_state.part(_Decisions).last, "decision", None)


#: The least KV cache a start-up asks the broker for: SGLang itself refuses a pool of no tokens
#: (``_resolve_memory_pool_config`` then explains why, with the broker's answer).
MIN_KV_BYTES = 1


def cap_available_bytes(runtime_bytes: int, device: Any, gpu_id: int | None = None, *, elastic: bool = False,
                        slack_bytes: int = 0) -> int:
    """The KV budget SGLang may use: its own figure, capped by what the broker admits.

    ``slack_bytes`` (what SGLang keeps beside the KV cache) is held in full with it, in the
    same request (:func:`..sizing.size`).  ``elastic`` (kvcached mode): the figure is a virtual
    budget; it is capped at what the broker could ever give the instance, and no KV is held.

    Every rank calls the world min-reduce exactly once, whatever happened with its broker:
    an unprotected rank offers SGLang's own figure, and a rank that must stop (a refusal, an
    eviction) raises only after the collective.
    """
    identity = parallel.identity(device, gpu_id)
    sized: sizing.Sized | None = None
    local_bytes = int(runtime_bytes)
    failure: Exception | None = None
    try:
        ask = sizing.StartupAsk("SGLang", int(runtime_bytes), MIN_KV_BYTES, int(slack_bytes), elastic)
        sized = sizing.size(identity, ask)
        if sized is not None:
            local_bytes = sized.kv_bytes
            reporting.sized(identity)  # its holds end with the scheduler's start-up
    except sizing.StartupRefused as exc:
        sized, local_bytes, failure = None, 0, kv_budget.BrokerBudgetError(str(exc))
    except Exception as exc:  # noqa: BLE001 - still take part in the collective, then fail
        sized, local_bytes, failure = None, int(runtime_bytes), exc
    agreed_bytes = parallel.world_group().reduce_min(local_bytes)  # every rank calls it, on every path
    if failure is not None:
        raise failure
    session = sessions.session(identity)
    decision = SizingDecision(int(runtime_bytes), agreed_bytes, sized, session.client.endpoint if session else "")
    process_state.part(_Decisions).last.decision = decision
    if sized is None:
        return agreed_bytes
    if agreed_bytes <= 0:
        raise kv_budget.BrokerBudgetError(str(sizing.refusal(
            identity, sizing.StartupAsk("SGLang", int(runtime_bytes), MIN_KV_BYTES, int(slack_bytes), elastic),
            "another TP rank of this server got no KV cache from its broker")))
    if not elastic and session is not None:
        session.shrink_kv_hold(agreed_bytes)  # another rank got less: keep only the agreed size
    log.info(
        "event=sglang_kv_sized device=%s rank=%d runtime=%s slack=%s broker_ever=%s kv=%s elastic=%s",
        identity.device, identity.tp_rank, format_bytes(int(runtime_bytes)), format_bytes(sized.slack_bytes),
        format_bytes(sized.ever_bytes), format_bytes(agreed_bytes), elastic,
    )
    return agreed_bytes


def runtime_slack_bytes(owner: Any, pre_model_load_memory: Any) -> int:
    """What SGLang keeps beside its KV cache: ``pre_model_load_memory`` (GB, as SGLang passes
    it) ``x (1 - mem_fraction_static)``; 0 when either is unknown."""
    fraction = _mem_fraction_static(owner)
    try:
        before_gb = float(pre_model_load_memory)
    except (TypeError, ValueError):
        return 0
    if fraction is None or not 0.0 < fraction <= 1.0 or before_gb <= 0:
        return 0
    return math.ceil(before_gb * (1.0 - fraction) * (1 << 30))  # up: a float's last bit never under-holds


def _mem_fraction_static(owner: Any) -> float | None:
    """SGLang's ``mem_fraction_static``: the model runner's own (up to 0.5.15), the published
    schedule config (0.5.16+), or the server args."""
    for value in (getattr(owner, "mem_fraction_static", None),
                  _published_fraction(),
                  getattr(getattr(owner, "server_args", None), "mem_fraction_static", None)):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _published_fraction() -> float | None:
    try:
        from sglang.srt.runtime_context import get_schedule

        return get_schedule().mem_fraction_static
    except Exception:  # noqa: BLE001 - a release without it, or nothing published
        return None


def charge_pools(device: Any, gpu_id: int | None, token_to_kv_pool: Any, *extra: Any, owner: Any = None) -> None:
    """Charge the pools just built (per pool for DeepSeek-V4, else one ``kv_static``).

    The charge and the sizing hold change in one broker request: the hold shrinks by what the
    pools add, and with the last pools of the start-up (no draft follows ``owner``, outside a
    scheduler start-up scope) what is left of it is dropped.  Storages another reporter already
    charged (a draft pool that views the target's buffer) are not charged again.
    """
    identity = parallel.identity(device, gpu_id)
    last = not startup.active() and not speculative.drafts_follow(owner)
    try:
        if token_to_kv_pool is not None:
            _charge(identity, token_to_kv_pool, extra, last)
    except BaseException:
        _drop_hold(identity)
        raise
    if last:
        _drop_hold(identity)


def _charge(identity: worker_identity.WorkerIdentity, pool: Any, extra: tuple, last: bool) -> None:
    if dsv4_reservation.is_dsv4_pool(pool):
        dsv4_reservation.register(pool, last=last)
        return
    if pool_bytes.is_managed(pool):
        return
    def measure(seen: set) -> dict[str, int] | None:
        size = sum(pool_bytes.object_bytes(obj, seen) for obj in (pool, *extra) if obj is not None)
        return {"kv_static": size} if size else None

    reporting.report_measured(identity, pool, "kv_static", measure, "its static KV pool", last=last)


def _drop_hold(identity: worker_identity.WorkerIdentity) -> None:
    if sessions.session(identity) is not None:
        reporting.release_hold(identity)


# ---------------------------------------------------------------------------- the wrappers
def wrap_profile(original: Callable[..., int]) -> Callable[..., int]:
    def cap(self: Any, pre_model_load_memory: Any, runtime_bytes: int, elastic: bool) -> int:
        return cap_available_bytes(runtime_bytes, getattr(self, "device", None), getattr(self, "gpu_id", None),
                                   elastic=elastic, slack_bytes=runtime_slack_bytes(self, pre_model_load_memory))

    return kvcached_sizing.outer_profile(original, cap)


def wrap_resolve(original: Callable[..., Any]) -> Callable[..., Any]:
    def _resolve_memory_pool_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        process_state.part(_Decisions).last.decision = None
        kvcached_sizing.ensure_outermost(type(self), wrap_profile)
        try:
            config = original(self, *args, **kwargs)
        except (RuntimeError, ValueError, AssertionError) as exc:
            raise _explained(exc) from exc
        tokens = getattr(config, "max_total_num_tokens", 1)
        if isinstance(tokens, int) and tokens <= 0:
            raise _explained(RuntimeError(f"the runtime sized a KV pool of {tokens} tokens"))
        return config

    return wrap_once(original, _resolve_memory_pool_config)


def _explained(exc: BaseException) -> BaseException:
    """The runtime's sizing failure, with the broker's context when the broker lowered the budget."""
    decision = last_decision()
    if isinstance(exc, kv_budget.BrokerBudgetError) or decision is None or decision.sized is None or not decision.lowered:
        return exc
    return kv_budget.BrokerBudgetError(
        f"kvcached-broker at {decision.endpoint} admitted {format_bytes(decision.capped_bytes)} of the "
        f"{format_bytes(decision.runtime_bytes)} KV cache SGLang profiled ({decision.sized.describe_holders()}), "
        f"and SGLang could not build a pool in it: {' '.join(str(exc).split())}")


def wrap_init_pools(original: Callable[..., Any]) -> Callable[..., Any]:
    def _init_pools(self: Any, *args: Any, **kwargs: Any) -> Any:
        kvcached_fallback.install()  # every patch has run by now: kvcached's allocators fall back for V4
        result = original(self, *args, **kwargs)
        built = result if result is not None and hasattr(result, "token_to_kv_pool") else self
        charge_pools(
            getattr(self, "device", None), getattr(self, "gpu_id", None),
            getattr(built, "token_to_kv_pool", None), getattr(built, "unified_memory_pool", None), owner=self,
        )
        return result

    return wrap_once(original, _init_pools)


_WRAPPERS = {
    "_profile_available_bytes": wrap_profile,
    "_resolve_memory_pool_config": wrap_resolve,
    "_init_pools": wrap_init_pools,
}


def _apply(module: Any, class_name: str) -> None:
    wrap_methods(module, class_name, _WRAPPERS)
    kvcached_sync.install()  # kvcached pools built here apply their limits at sync points
    kvcached_fallback.install()  # kvcached's elastic allocators, aliased by now, fall back for other pools


def apply_configurator(module: Any) -> None:
    """Patch ``KVCacheConfigurator`` in ``sglang.srt.mem_cache.kv_cache_configurator`` (0.5.16+)."""
    _apply(module, "KVCacheConfigurator")


def apply_mixin(module: Any) -> None:
    """Patch ``ModelRunnerKVCacheMixin`` in ``model_runner_kv_cache_mixin`` (0.5.12-0.5.15)."""
    _apply(module, "ModelRunnerKVCacheMixin")


def wrap_capacity_patch(original: Callable[..., Any]) -> Callable[..., Any]:
    """kvcached's ``patch_profile_available_bytes``, then the broker's cap put back outside what
    it wrapped."""

    def patch_profile_available_bytes(self: Any, target_module: Any) -> Any:
        result = original(self, target_module)
        target = getattr(target_module, getattr(self, "target_class", "") or "", None)
        if isinstance(target, type):
            kvcached_sizing.ensure_outermost(target, wrap_profile)
        return result

    return wrap_once(original, patch_profile_available_bytes)


def apply_kvcached_patches(module: Any) -> None:
    """Patch kvcached's own SGLang patch module (``kvcached.integration.sglang.patches``): right
    after kvcached wraps ``_profile_available_bytes``, the broker's cap is put back outside it.
    A kvcached without this class (or whose class inherits the method) is reported by the
    patch, which is optional: ``ensure_outermost`` at ``_resolve_memory_pool_config`` covers it."""
    wrap_methods(module, kvcached_sizing.CAPACITY_PATCH_CLASS,
                 {"patch_profile_available_bytes": wrap_capacity_patch})
