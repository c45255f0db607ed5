"""What a reset of the adapters' process state (``process_state.reset``, which ``process_state.reset``
calls) leaves of the SGLang adapter: the wiring of classes already patched stays as it was, so
the patches, which never run again, keep working; reporter keys are never given out twice.

Real SGLang classes from the overlay, patched by the adapter.
"""

from __future__ import annotations

import pytest
import sglang_cpu

from kvcached_broker.adapters import process_state
from kvcached_broker.adapters.sglang import kv_sizing, kvcached_fallback, kvcached_sizing, paged_allocator, reporting

pytestmark = pytest.mark.runtime("sglang")


class _Pool:
    """Any object a pool reporter can be keyed by."""


def test_a_reset_keeps_the_allocator_class_sglang_is_bound_to(patched_sglang):
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator as bound

    upstream = next(c for c in bound.__mro__ if c is not bound and c.__name__ == bound.__name__)
    assert paged_allocator.broker_class(upstream) is bound
    process_state.reset()
    assert paged_allocator.broker_class(upstream) is bound  # not a second class of the same name
    # kvcached's fallback finds SGLang's own class as the binding patch recorded it (0.5.12: only there)
    assert kvcached_fallback.native_class(paged_allocator.CLASS_NAME) is bound


def test_a_reset_keeps_the_broker_cap_outermost_without_wrapping_it_again(patched_sglang):
    if sglang_cpu.at_least("0.5.16"):
        from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator as cls
    else:
        from sglang.srt.model_executor.model_runner_kv_cache_mixin import ModelRunnerKVCacheMixin as cls
    ours = vars(cls)[kvcached_sizing.METHOD]
    process_state.reset()
    assert not kvcached_sizing.ensure_outermost(cls, kv_sizing.wrap_profile)
    assert vars(cls)[kvcached_sizing.METHOD] is ours
    assert kvcached_sizing.outer_profile(ours, lambda *args: 0) is ours


def test_reporter_keys_are_never_given_twice_in_a_process_even_across_a_reset(adapter_state):
    """A pool from before a reset is finalised later under its key, which forgets that key's
    reservation: it must not be the key of a pool reported after the reset."""
    process_state.reset()
    before = _Pool()
    first = reporting.reporter_key(before, "kv")
    process_state.reset()
    after = _Pool()
    assert reporting.reporter_key(after, "kv") != first
    assert reporting.reporter_key(before, "kv") != first  # the reset forgot the pool's key too
