"""The vLLM patch set: version gates, symbol gates, idempotence, and EngineCore's patch."""

from __future__ import annotations

import importlib
from types import ModuleType, SimpleNamespace

import pytest

from kvcached_broker.adapters import announce, autopatch, import_hook, patching, release_check, support
from kvcached_broker.adapters.patching import PatchError, apply_patch
from kvcached_broker.adapters.vllm import engine, patches, prefix_eviction

import vllm_shapes as shapes
from helpers import MIB, adapter_line

pytestmark = pytest.mark.runtime("vllm")

WORKER_SIDE = {"vllm_kv_alloc_attn_utils", "vllm_kv_sizing"}
ENGINE_SIDE = {"vllm_engine_core", "vllm_prefix_eviction"}


def outcomes(results) -> dict[str, str]:
    return {r.patch: r.outcome for r in results}


def test_every_hook_of_this_release_applies(patched_vllm, vllm_version):
    """Each patch of this release's layout (adapters/support.py's gates) applies, and no other is
    even registered: a module of another layout is never imported for nothing."""
    seen = outcomes(patched_vllm)
    for name in WORKER_SIDE | ENGINE_SIDE:
        assert seen[name] in ("applied", "already"), (name, seen[name])
    vllm = support.VLLM
    layout = {p.name for p in patches.layout_patches(vllm_version)}
    assert ("vllm_kv_alloc_utils" in layout) == vllm.at_least("shared_buffer", vllm_version)
    assert ("vllm_kv_alloc_uniform" in layout) != vllm.at_least("shared_buffer", vllm_version)  # cross-layer
    assert ("vllm_kv_alloc_hisparse" in layout) == vllm.at_least("hisparse", vllm_version)
    assert ("vllm_kv_alloc_model_runner" in layout) != vllm.at_least("v2_runner_only", vllm_version)
    assert ("vllm_kv_extensible" in layout) == vllm.at_least("extensible_kv_cache", vllm_version)
    for name in layout:
        if name != "vllm_kvcached_sizing":  # kvcached's module: only in kvcached mode
            assert seen[name] in ("applied", "already"), (name, seen[name])
    assert {r.patch for r in patched_vllm if r.patch.startswith("vllm_")} <= layout


def test_patches_are_idempotent(patched_vllm):
    for patch in patches.PATCHES:
        if not patch.required:  # optional: its module may not exist here (hisparse, kvcached's)
            continue
        module = importlib.import_module(patch.module)
        if getattr(module, f"__kvcached_broker_patched_{patch.name}__", False):
            assert apply_patch(patch, module).outcome == "already"


def test_a_release_outside_the_range_is_skipped_with_a_clear_reason(monkeypatch, capsys):
    announce.reset()
    monkeypatch.setattr(patching, "installed", lambda dist: "0.18.0")
    patch = next(p for p in patches.PATCHES if p.name == "vllm_kv_sizing")
    result = apply_patch(patch, ModuleType("vllm.v1.worker.gpu_worker"))
    assert result.outcome == "skipped"
    assert f"vllm 0.18.0 is outside the supported range {support.VLLM.supported}" in result.reason

    newer = f"{support.VLLM.supported.below}.5"  # the startup hook registers no patch for it: one line
    monkeypatch.setattr(release_check, "installed", lambda dist: newer if dist == "vllm" else None)
    capsys.readouterr()
    registered = len(import_hook.watched())
    autopatch._unsupported(release_check.finding("vllm"))  # what apply() does for it, once per process
    autopatch._unsupported(release_check.finding("vllm"))
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert line.startswith("kvcached-broker: WARNING ") and "event=unprotected pid=" in line
    assert f"runtime=vllm version={newer} supported='{support.VLLM.supported}'" in line
    assert len(import_hook.watched()) == registered


def test_a_module_without_the_hooked_symbol_fails_clearly_and_only_raises_under_require(monkeypatch):
    patch = next(p for p in patches.ALL_PATCHES if p.name == "vllm_kv_alloc_model_runner")
    monkeypatch.setattr(patching, "installed", lambda dist: support.VLLM.supported.minimum)  # the runner's layout
    empty = ModuleType("vllm.v1.worker.gpu_model_runner")
    result = apply_patch(patch, empty)
    assert result.outcome == "failed" and "neither allocate_kv_cache nor" in result.reason
    monkeypatch.setenv("KVCACHED_REQUIRE", "1")
    with pytest.raises(PatchError, match="KVCACHED_REQUIRE=1"):
        apply_patch(patch, ModuleType("vllm.v1.worker.gpu_model_runner"))


def test_engine_core_with_vllms_own_block_pool_attaches_no_eviction_hook(patched_vllm, gpu_broker):
    """Without kvcached, the scheduler's pool is vLLM's own: nothing to evict under pressure."""
    vc, kv_cfg = shapes.hybrid_config(16 * MIB)
    manager = shapes.kv_cache_manager(vc, kv_cfg)
    core = SimpleNamespace(scheduler=SimpleNamespace(kv_cache_manager=manager))
    assert prefix_eviction.attach(core) is None and prefix_eviction.hook_of(manager.block_pool) is None


def test_the_engine_core_init_and_the_schedulers_step_are_patched(patched_vllm):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    assert getattr(EngineCore.__init__, "__kvcached_broker_wrapped__", False)
    assert getattr(Scheduler.schedule, "__kvcached_broker_wrapped__", False)
    assert engine.wrap_engine_init(EngineCore.__init__) is EngineCore.__init__  # wrapped once


def test_enable_kvcached_patches_every_binding_at_import(tmp_path):
    """The real start-up path: the .pth hook, then vLLM's own import order, in a fresh interpreter."""
    import json
    import os
    import subprocess
    import sys

    probe = (
        "import json, importlib, importlib.util\n"
        "import vllm.v1.worker.gpu.attn_utils as attn\n"
        "import vllm.v1.worker.gpu_worker as gw, vllm.v1.core.sched.scheduler as sched, vllm.v1.engine.core as core\n"
        "w = lambda f: bool(getattr(f, '__kvcached_broker_wrapped__', False))\n"
        "alloc = True\n"
        "if importlib.util.find_spec('vllm.v1.worker.gpu_model_runner'):  # the V1 runner, before 0.34\n"
        "    import vllm.v1.worker.gpu_model_runner as runner\n"
        "    alloc = getattr(runner, 'allocate_kv_cache', None) or runner.GPUModelRunner._allocate_kv_cache_tensors\n"
        "attn_alloc = getattr(attn, 'allocate_kv_cache', None) or attn._allocate_kv_cache\n"
        "print(json.dumps([alloc is True or w(alloc), w(attn_alloc), w(gw.Worker.determine_available_memory),\n"
        "                  w(sched.Scheduler.schedule), w(core.EngineCore.__init__)]))\n"
    )
    env = {**os.environ, "ENABLE_KVCACHED": "1", "KVCACHED_BROKER": "off", "VLLM_LOGGING_LEVEL": "ERROR"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True] * 5
    # vLLM configured its logging at import (its own logger, propagate off, here at ERROR): the
    # adapter's INFO lines still reach stderr, once each, with prefix, level and time
    applied = [line for line in out.stderr.splitlines() if "event=patch " in line and "outcome=applied" in line]
    assert applied and all(adapter_line(line, "INFO", "patch") for line in applied), out.stderr[-2000:]
    assert len(applied) == len(set(line.split(" ", 4)[4] for line in applied))


def test_the_kvcached_sizing_patch_wraps_only_kvcacheds_own_method_once():
    """``GPUWorkerPatch.patch_worker_determine_available_memory`` must be the class's own (a patch
    of an inherited one would change its base class); wrapped twice, it is wrapped once."""
    from kvcached_broker.adapters.vllm import kv_sizing

    class Base:
        def patch_worker_determine_available_memory(self, gpuworker_mod):
            return True

    inherited = ModuleType("kvcached.integration.vllm.patches")
    inherited.GPUWorkerPatch = type("GPUWorkerPatch", (Base,), {})
    with pytest.raises(PatchError, match="lacks patch_worker_determine_available_memory"):
        kv_sizing.apply_kvcached_patches(inherited)
    assert "patch_worker_determine_available_memory" not in vars(inherited.GPUWorkerPatch)

    own = ModuleType("kvcached.integration.vllm.patches")
    own.GPUWorkerPatch = type("GPUWorkerPatch", (), {"patch_worker_determine_available_memory":
                                                     Base.patch_worker_determine_available_memory})
    kv_sizing.apply_kvcached_patches(own)
    wrapped = own.GPUWorkerPatch.patch_worker_determine_available_memory
    kv_sizing.apply_kvcached_patches(own)
    assert own.GPUWorkerPatch.patch_worker_determine_available_memory is wrapped
    assert getattr(wrapped, patching.WRAPPED)


def test_the_kv_allocation_patches_need_the_runners_own_method_when_the_module_binds_no_function():
    from kvcached_broker.adapters.vllm import kv_reservation

    class Base:
        def _allocate_kv_cache_tensors(self, kv_cache_config):
            return {}

    module = ModuleType("vllm.v1.worker.gpu_model_runner")
    module.GPUModelRunner = type("GPUModelRunner", (Base,), {})
    with pytest.raises(PatchError, match="GPUModelRunner lacks _allocate_kv_cache_tensors"):
        kv_reservation.apply_gpu_model_runner(module)
    module.GPUModelRunner = type("GPUModelRunner", (), {"_allocate_kv_cache_tensors": Base._allocate_kv_cache_tensors})
    kv_reservation.apply_gpu_model_runner(module)
    kv_reservation.apply_gpu_model_runner(module)
    method = module.GPUModelRunner._allocate_kv_cache_tensors
    assert getattr(method, patching.WRAPPED) and method.__wrapped__ is Base._allocate_kv_cache_tensors
