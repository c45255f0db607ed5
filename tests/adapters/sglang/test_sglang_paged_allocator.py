"""The paged allocator under the adapter: bindings, precomputed page counts, stale ids.

Real SGLang allocators from the overlay (package layout, 0.5.13+); the legacy single-module
layout (<= 0.5.12) through ``legacy_allocator``, a fake of the same shape, because no overlay
of that release is built for CI.  On 0.5.13 the real ``alloc_extend``/``alloc_decode`` Triton
kernels run under ``TRITON_INTERPRET=1`` (set in conftest).
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

import legacy_allocator
import sglang_cpu

from kvcached_broker.adapters.sglang import allocator_binding

pytestmark = pytest.mark.runtime("sglang")

PS = 16  # tokens per page
PAGES = 32


def t(*values):
    return torch.tensor(values, dtype=torch.int64)


@pytest.fixture
def ours(patched_sglang):
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    return PagedTokenToKVPoolAllocator


def upstream_of(cls):
    return next(c for c in cls.__mro__ if c.__module__.startswith(("sglang.", "legacy_allocator")))


def make(cls, pages=PAGES, need_sort=False):
    return cls(pages * PS, PS, torch.bfloat16, "cpu", None, need_sort)


def test_the_adapter_class_is_bound_where_allocators_are_built(ours):
    upstream = upstream_of(ours)
    assert ours is not upstream and issubclass(ours, upstream) and ours.__name__ == upstream.__name__
    split = sglang_cpu.at_least("0.5.13")
    sites = ["sglang.srt.mem_cache.allocator.swa" if split else "sglang.srt.mem_cache.swa_memory_pool"]
    sites.append("sglang.srt.mem_cache.kv_cache_configurator" if sglang_cpu.at_least("0.5.16")
                 else "sglang.srt.model_executor.model_runner_kv_cache_mixin")
    for site in sites:
        assert importlib.import_module(site).PagedTokenToKVPoolAllocator is ours, site
    if split:
        assert importlib.import_module("sglang.srt.mem_cache.allocator.paged").PagedTokenToKVPoolAllocator is upstream
    if sglang_cpu.at_least("0.5.20"):
        from sglang.srt.mem_cache.allocator.hisparse import PagedTokenToKVPoolAllocator as seen_by_hisparse

        assert seen_by_hisparse is upstream  # subclassing modules keep the upstream class


def test_instances_of_further_subclasses_behave_like_upstream(ours):
    class PlatformAllocator(ours):
        pass

    alloc = make(PlatformAllocator)
    pages = alloc.alloc(2 * PS)
    alloc.free(pages)
    alloc.free(pages)  # upstream semantics: a double free is not caught for a subclass's instance
    assert alloc.available_size() == (PAGES + 2) * PS and alloc.stale_free_ids == 0


def _extend_args(prefix=(0, 0), seq=(40, 5)):
    pre, s = t(*prefix), t(*seq)
    return pre, pre.clone(), s, s.clone(), t(*([-1] * len(prefix))), int((s - pre).sum())


def _module_of_alloc_extend(cls):
    return sys.modules[upstream_of(cls).__module__]


def test_alloc_extend_takes_a_precomputed_page_count_without_calling_get_num_new_pages(ours, monkeypatch):
    expected = make(ours).alloc_extend(*_extend_args())
    module = _module_of_alloc_extend(ours)

    def refuse(*args, **kwargs):
        raise AssertionError("get_num_new_pages called")

    monkeypatch.setattr(module, "get_num_new_pages", refuse)
    alloc = make(ours)
    with pytest.raises(AssertionError, match="get_num_new_pages called"):
        alloc.alloc_extend(*_extend_args())  # the patch target is where upstream looks it up
    alloc = make(ours)
    out = alloc.alloc_extend(*_extend_args(), num_new_pages=4)  # ceil(40/16) + ceil(5/16)
    assert torch.equal(out, expected)
    assert alloc.available_size() == (PAGES - 4) * PS


def test_stale_and_out_of_range_ids_never_reach_the_free_list(ours, capsys):
    plain = make(upstream_of(ours))
    pages = plain.alloc(2 * PS)
    plain.free(pages)
    plain.free(pages)
    assert plain.available_size() == (PAGES + 2) * PS  # upstream: the double free hands pages out twice

    alloc = make(ours)
    pages = alloc.alloc(2 * PS)
    alloc.free(pages)
    capsys.readouterr()
    alloc.free(pages)  # stale
    alloc.free(t(0, 3, (PAGES + 1) * PS, 10**6))  # the padding page, past the pool
    assert alloc.available_size() == PAGES * PS
    assert alloc.stale_free_ids == 2 * PS + 4
    warned = [line for line in capsys.readouterr().err.splitlines() if "event=sglang_stale_free" in line]
    assert len(warned) == 1 and warned[0].startswith("kvcached-broker: WARNING ")  # logged once


def test_in_debug_mode_a_double_free_reaches_upstreams_own_check(ours, monkeypatch):
    """``SGLANG_DEBUG_MEMORY_POOL=1``: upstream checks frees itself, so nothing is filtered first."""
    monkeypatch.setenv("SGLANG_DEBUG_MEMORY_POOL", "1")
    alloc = make(ours)
    assert alloc.debug_mode
    out = alloc.alloc(2 * PS)
    alloc.free(out)
    assert alloc.available_size() == PAGES * PS and alloc.stale_free_ids == 0
    with pytest.raises(AssertionError):  # upstream's _debug_check_no_duplicate_pages (or its equivalent)
        alloc.free(out)
    monkeypatch.delenv("SGLANG_DEBUG_MEMORY_POOL")
    quiet = make(ours)
    out = quiet.alloc(2 * PS)
    quiet.free(out)
    quiet.free(out)  # without debug mode the adapter drops the double free
    assert quiet.available_size() == PAGES * PS and quiet.stale_free_ids == 2 * PS


def test_a_mixed_free_keeps_the_live_ids(ours):
    alloc = make(ours)
    live, dead = alloc.alloc(PS), alloc.alloc(PS)
    alloc.free(dead)
    alloc.free(torch.cat([live, dead]))
    assert alloc.available_size() == PAGES * PS and alloc.stale_free_ids == PS


def test_frees_deferred_by_a_free_group_are_checked_when_the_group_ends(ours):
    alloc = make(ours)
    pages = alloc.alloc(3 * PS)
    alloc.free_group_begin()
    alloc.free(pages)
    alloc.free(pages[:PS])
    alloc.free_group_end()
    assert alloc.available_size() == PAGES * PS
    assert alloc.alloc(PAGES * PS) is not None and alloc.alloc(PS) is None  # each page exactly once


def test_clear_makes_every_outstanding_id_stale(ours):
    alloc = make(ours)
    pages = alloc.alloc(2 * PS)
    alloc.clear()
    alloc.free(pages)
    assert alloc.available_size() == PAGES * PS and alloc.stale_free_ids == 2 * PS


def test_decode_and_extend_mark_pages_in_use(ours):
    alloc = make(ours)
    out = alloc.alloc_extend(*_extend_args())
    dec = alloc.alloc_decode(t(41, 6), t(41, 6), torch.stack([out[39], out[44]]))
    assert dec is not None and alloc.available_size() == (PAGES - 4) * PS
    alloc.free(torch.cat([out, dec]))
    alloc.free(out)  # a retried free of the same request
    assert alloc.available_size() == PAGES * PS and alloc.stale_free_ids == out.numel()


@pytest.mark.skipif(not sglang_cpu.at_least("0.5.20"), reason="free_page_ids/free_segment are 0.5.20+")
def test_free_page_ids_drops_duplicates_and_stale_pages(ours):
    alloc = make(ours)
    pages = torch.unique(alloc.alloc(3 * PS) // PS)
    alloc.free_page_ids(torch.cat([pages, pages[:1], t(0, PAGES + 5)]))
    assert alloc.available_size() == PAGES * PS and alloc.stale_free_ids == 3
    segment = alloc.alloc(2 * PS)
    alloc.free_segment(segment, start_pos=0)
    alloc.free_segment(segment, start_pos=0)
    assert alloc.available_size() == PAGES * PS and alloc.stale_free_ids == 5


@pytest.mark.skipif(sglang_cpu.at_least("0.5.14"), reason="backup_state/restore_state are 0.5.12-0.5.13")
def test_a_restored_state_restores_which_pages_are_in_use(ours):
    alloc = make(ours)
    kept = alloc.alloc(PS)
    state = alloc.backup_state()
    rolled_back = alloc.alloc(2 * PS)
    alloc.restore_state(state)
    alloc.free(rolled_back)  # back on the free list already: freeing it again would duplicate it
    alloc.free(kept)
    assert alloc.available_size() == PAGES * PS and alloc.stale_free_ids == 2 * PS


def test_the_dsv4_swa_allocator_builds_tracked_sub_allocators(ours, sg_broker):
    if sglang_cpu.at_least("0.5.13"):
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    else:
        from sglang.srt.mem_cache.swa_memory_pool import SWATokenToKVPoolAllocator

    pool = sglang_cpu.build_dsv4_pool(full_pages=16, swa_pages=8)
    size, swa_size = 16 * sglang_cpu.PAGE, 8 * sglang_cpu.PAGE
    with sglang_cpu.runtime_config():
        alloc = SWATokenToKVPoolAllocator(size, swa_size, sglang_cpu.PAGE, torch.float8_e4m3fn, "cpu", pool, False)
    assert type(alloc.full_attn_allocator) is ours and type(alloc.swa_attn_allocator) is ours
    out = alloc.alloc_extend(t(0), t(0), t(300), t(300), t(-1), 300)
    assert out is not None and alloc.full_available_size() == size - 2 * sglang_cpu.PAGE
    alloc.free(out)
    alloc.free(out)
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (size, swa_size)
    assert alloc.full_attn_allocator.stale_free_ids == 300


# ------------------------------------------------------------------ legacy layout (<= 0.5.12)
@pytest.fixture
def legacy():
    """The legacy modules after the patches' binding function ran on them, as on 0.5.12."""
    allocator, swa = legacy_allocator.legacy_modules()
    upstream = allocator.PagedTokenToKVPoolAllocator
    allocator_binding.apply_binding(allocator)  # patch sglang_paged_allocator
    allocator_binding.apply_binding(swa)  # patch sglang_paged_allocator_swa_legacy
    return allocator, swa, upstream


def test_legacy_layout_binds_the_module_and_the_swa_pool(legacy):
    allocator, swa, upstream = legacy
    assert allocator.PagedTokenToKVPoolAllocator is swa.PagedTokenToKVPoolAllocator
    assert issubclass(allocator.PagedTokenToKVPoolAllocator, upstream)
    sub = swa.SWATokenToKVPoolAllocator(PAGES * PS, 8 * PS, PS, torch.bfloat16, "cpu", None, False)
    assert type(sub.full_attn_allocator) is allocator.PagedTokenToKVPoolAllocator


def test_legacy_layout_precomputed_pages_stale_ids_and_free_groups(legacy):
    allocator, _, _ = legacy
    alloc = make(allocator.PagedTokenToKVPoolAllocator)
    before = legacy_allocator.GET_NUM_NEW_PAGES_CALLS
    out = alloc.alloc_extend(*_extend_args(), num_new_pages=4)
    assert legacy_allocator.GET_NUM_NEW_PAGES_CALLS == before and out.numel() == 45
    alloc.alloc_extend(*_extend_args(prefix=(0,), seq=(3,)))
    assert legacy_allocator.GET_NUM_NEW_PAGES_CALLS == before + 1  # None: upstream counts as before
    alloc.free(out)
    alloc.free(out)
    alloc.free_group_begin()
    alloc.free(t(5 * PS, (PAGES + 3) * PS))
    alloc.free_group_end()
    assert alloc.available_size() == PAGES * PS and alloc.stale_free_ids == 45 + 1
    state = alloc.backup_state()
    taken = alloc.alloc(PS)
    alloc.restore_state(state)
    alloc.free(taken)
    assert alloc.available_size() == PAGES * PS and alloc.stale_free_ids == 45 + 1 + PS


def test_an_allocator_without_num_new_pages_is_refused(patched_sglang):
    class Old:  # SGLang < 0.5.12: alloc_extend has no num_new_pages
        def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens):
            return None

    from kvcached_broker.adapters.patching import PatchError

    module = type(sys)("old_sglang_allocator")
    module.PagedTokenToKVPoolAllocator = Old
    with pytest.raises(PatchError, match="no num_new_pages"):
        allocator_binding.apply_binding(module)
