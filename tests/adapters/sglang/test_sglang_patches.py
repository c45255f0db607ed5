"""The SGLang patch set: applied on import or explicitly, version-gated, idempotent, loud."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types

import pytest

import sglang_cpu

from kvcached_broker.adapters import autopatch, patching, support
from kvcached_broker.adapters.patching import PatchError, apply_patch
from kvcached_broker.adapters.sglang import dsv4_reservation, kv_sizing, kvcached_buffers, kvcached_sizing, patches

pytestmark = pytest.mark.runtime("sglang")

WORKER = os.path.join(os.path.dirname(__file__), "sglang_worker.py")


def _names(version: str) -> set[str]:
    return {p.name for p in patches.patches_for(version)}


def test_the_patch_list_follows_the_module_layout_of_each_release():
    legacy, split, newest = _names("0.5.12"), _names("0.5.13.post1"), _names("0.5.23")
    assert {"sglang_paged_allocator_swa_legacy", "sglang_kv_sizing_mixin"} <= legacy
    assert not {"sglang_paged_allocator_swa", "sglang_kv_sizing_configurator"} & legacy
    assert {"sglang_paged_allocator_swa", "sglang_kv_sizing_mixin", "sglang_paged_allocator_mixin"} <= split
    assert "sglang_dsv4_request_window" not in split and "sglang_paged_allocator_swa_legacy" not in split
    assert {"sglang_kv_sizing_configurator", "sglang_paged_allocator_configurator",
            "sglang_dsv4_request_window"} <= newest and "sglang_kv_sizing_mixin" not in newest
    assert _names("0.5.24") == _names("0.5.11") == {p.name for p in patches.ALL_PATCHES}  # each logs its skip


def test_every_patch_for_this_release_applied_once(patched_sglang, sglang_version):
    if sglang_cpu.at_least("0.5.21"):
        importlib.import_module("sglang.srt.mem_cache.dsv41_request_window")
    applied = {r.patch for r in patching.results() if r.outcome == "applied"}
    for patch in patches.PATCHES:
        if patch.module == "sglang.srt.managers.scheduler":
            continue  # the scheduler module: test_sglang_measured_device (it imports only on 0.5.23 here)
        if patch.module.startswith("kvcached."):
            continue  # kvcached's own module: kvcached mode, tests/adapters/sglang/test_kvcached_sglang_*
        module = sys.modules[patch.module]
        assert patch.name in applied and getattr(module, f"__kvcached_broker_patched_{patch.name}__"), patch.name
        again = apply_patch(patch, module)
        assert again.outcome == "already"
    assert not [r for r in patching.results() if r.patch.startswith("sglang_") and r.outcome == "failed"]


def test_wrappers_are_idempotent(patched_sglang):
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    module = sys.modules["sglang.srt.mem_cache.deepseek_v4_memory_pool"]
    wrapped = DeepSeekV4TokenToKVPool.__init__
    dsv4_reservation.apply_memory_pool(module)
    assert DeepSeekV4TokenToKVPool.__init__ is wrapped and not hasattr(wrapped.__wrapped__, "__wrapped__")
    sizing = next(p for p in patches.PATCHES if p.name.startswith("sglang_kv_sizing"))
    module = sys.modules[sizing.module]
    cls = module.KVCacheConfigurator if sglang_cpu.at_least("0.5.16") else module.ModelRunnerKVCacheMixin
    profile = vars(cls)["_profile_available_bytes"]
    sizing.apply(module)
    assert vars(cls)["_profile_available_bytes"] is profile


def test_a_release_outside_the_range_logs_a_clear_skip(monkeypatch):
    monkeypatch.setattr(patching, "installed", lambda dist: "0.5.30")
    monkeypatch.setattr(patches, "installed", lambda dist: "0.5.30")
    target = types.ModuleType("fake_sglang_module")
    patch = patches.ALL_PATCHES[0]
    result = apply_patch(patch, target)
    assert result.outcome == "skipped"
    assert result.reason == f"sglang 0.5.30 is outside the supported range {support.SGLANG.supported}"
    monkeypatch.setenv("KVCACHED_REQUIRE", "1")
    with pytest.raises(PatchError, match="outside the supported range"):
        apply_patch(patch, target)


def test_a_patch_that_cannot_apply_fails_loudly_only_under_require(monkeypatch):
    broken = types.ModuleType("sglang.srt.mem_cache.deepseek_v4_memory_pool")  # the class is missing
    patch = next(p for p in patches.ALL_PATCHES if p.name == "sglang_dsv4_pool_reservation")
    assert apply_patch(patch, broken).outcome == "failed"
    monkeypatch.setenv("KVCACHED_REQUIRE", "1")
    with pytest.raises(PatchError, match=r"sglang_dsv4_pool_reservation .* has no DeepSeekV4TokenToKVPool"):
        apply_patch(patch, broken)


def test_the_kvcached_sizing_order_patch_says_when_kvcached_lacks_its_capacity_class(monkeypatch):
    """Optional (the cap is put back outside kvcached's at the pool config too), so said, never an error."""
    monkeypatch.setenv("KVCACHED_REQUIRE", "1")
    patch = next(p for p in patches.ALL_PATCHES if p.name == "sglang_kvcached_sizing_order")
    missing = types.ModuleType("kvcached.integration.sglang.patches")
    result = apply_patch(patch, missing)
    assert result.outcome == "failed" and "has no _SGLangVirtualKVCapacityPatchBase" in result.reason

    class Base:
        def patch_profile_available_bytes(self, target_module):
            return True

    inherits = types.ModuleType("kvcached.integration.sglang.patches")
    inherits._SGLangVirtualKVCapacityPatchBase = type("_SGLangVirtualKVCapacityPatchBase", (Base,), {})
    result = apply_patch(patch, inherits)
    assert result.outcome == "failed" and "lacks patch_profile_available_bytes" in result.reason
    assert not getattr(Base.patch_profile_available_bytes, patching.WRAPPED, False)  # the base is left alone

    own = types.ModuleType("kvcached.integration.sglang.patches")
    own._SGLangVirtualKVCapacityPatchBase = type("_SGLangVirtualKVCapacityPatchBase", (Base,),
                                                 {"patch_profile_available_bytes": lambda self, module: True})
    assert apply_patch(patch, own).outcome == "applied"
    wrapped = vars(own._SGLangVirtualKVCapacityPatchBase)["patch_profile_available_bytes"]
    kv_sizing.apply_kvcached_patches(own)
    assert vars(own._SGLangVirtualKVCapacityPatchBase)["patch_profile_available_bytes"] is wrapped  # once


def test_the_kvcached_buffers_patch_wraps_the_pools_own_method_once(monkeypatch):
    patch = next(p for p in patches.ALL_PATCHES if p.name == "sglang_kvcached_buffers")

    def pool_module(**methods):
        module = types.ModuleType("sglang.srt.mem_cache.memory_pool")
        module.MHATokenToKVPool = type("MHATokenToKVPool", (), methods)
        return module

    module = pool_module(_build_kv_buffer_descs=lambda self: "descs")
    assert apply_patch(patch, module).outcome == "applied"
    wrapped = vars(module.MHATokenToKVPool)["_build_kv_buffer_descs"]
    assert getattr(wrapped, patching.WRAPPED) and wrapped(object()) == "descs"
    kvcached_buffers.apply_memory_pool(module)
    assert vars(module.MHATokenToKVPool)["_build_kv_buffer_descs"] is wrapped
    older = pool_module()  # 0.5.12 and 0.5.13 build no descriptors: nothing to wrap, nothing wrong
    assert apply_patch(patch, older).outcome == "applied" and not vars(older.MHATokenToKVPool).keys() & {
        "_build_kv_buffer_descs"}
    result = apply_patch(patch, types.ModuleType("sglang.srt.mem_cache.memory_pool"))  # no pool class at all
    assert result.outcome == "failed" and "has no MHATokenToKVPool" in result.reason


def test_the_sizing_cap_goes_back_outside_a_wrapper_that_copied_our_mark():
    """kvcached wraps SGLang's profile over ours with ``functools.wraps``, which copies our mark."""
    import functools

    def profile(self, pre_model_load_memory):
        return 100

    ours = kvcached_sizing.outer_profile(profile, lambda owner, pre_model_load_memory, runtime_bytes, elastic: runtime_bytes // 2)

    @functools.wraps(ours)
    def theirs(self, pre_model_load_memory):
        return ours(self, pre_model_load_memory)

    assert getattr(theirs, patching.WRAPPED)  # copied: the mark alone cannot tell ours
    outer = kvcached_sizing.outer_profile(theirs, lambda owner, pre_model_load_memory, runtime_bytes, elastic: runtime_bytes // 2)
    assert outer is not theirs and getattr(outer, patching.WRAPPED) and outer.__name__ == "profile"
    assert kvcached_sizing.outer_profile(outer, lambda *a: 0) is outer
    assert outer(object(), 0) == 50  # one cap, outside: the inner wrapper passes straight through


def test_the_kv_pool_bridge_is_refused(monkeypatch):
    monkeypatch.setenv("KVCACHED_SGLANG_DSV4_KV_POOL_BRIDGE", "1")
    with pytest.raises(PatchError, match="future work"):
        autopatch.apply(["sglang"])


def test_require_with_no_broker_stops_a_worker_at_startup(short_tmp):
    env = {**os.environ, "ENABLE_KVCACHED": "1", "KVCACHED_REQUIRE": "1", "KVCACHED_BROKER_TIMEOUT_S": "0.3",
           "KVCACHED_BROKER": f"ipc://{short_tmp}/absent{{device}}.sock", "KVCACHED_BROKER_INSTANCE": "needs-broker"}
    out = subprocess.run([sys.executable, WORKER, "dsv4", "8", "4"], env=env, capture_output=True, text=True,
                         timeout=120, stdin=subprocess.DEVNULL, check=False)
    assert out.returncode != 0 and out.stdout == ""
    assert "BrokerRequired: kvcached-broker is required (KVCACHED_REQUIRE=1) but unusable for device 0" in out.stderr
    assert f"{short_tmp}/absent0.sock" in out.stderr
