"""A pytest plugin that runs upstream's own tests with the adapter's patches on, or off.

``scripts/upstream-tests.py run`` runs the upstream test files fetched into
``.adapter-envs/upstream/<overlay>`` (tests/adapters/upstream/MANIFEST.tsv) twice with this
plugin (``-p kvcached_patches_on``): once with ``KVCACHED_UPSTREAM_PATCHES=off`` and once with
``on``, and fails if any test's outcome differs.  What must never happen is a test that passes
without the patches and not with them (a double free that no longer reaches
``SGLANG_DEBUG_MEMORY_POOL``'s check, say).

With the patches on, the plugin applies them before any test is collected and refuses to
run if the class upstream's tests build is not the adapter's.  Tests named in
``KVCACHED_UPSTREAM_DESELECT`` (JSON: ``PATH::TEST`` -> reason; every parametrization) are
deselected.  Each test's outcome is written to ``KVCACHED_UPSTREAM_OUTCOMES`` (JSON:
``{"outcomes": {node id: passed/failed/skipped}, "deselected": {PATH::TEST: count},
"applied": [the adapter patches that applied]}``).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os

import pytest

#: runtime -> the classes upstream's tests use that the adapter may patch: with the patches on, at
#: least one must be the adapter's, with them off none.  SGLang: the paged allocator.  vLLM: the
#: block pool, the KV cache manager and the scheduler (the adapter has patched the first two in
#: some versions and wraps ``Scheduler.schedule`` for prefix eviction).
PATCHED = {
    "sglang": [("sglang.srt.mem_cache.allocator", "PagedTokenToKVPoolAllocator")],
    "vllm": [("vllm.v1.core.block_pool", "BlockPool"), ("vllm.v1.core.kv_cache_manager", "KVCacheManager"),
             ("vllm.v1.core.sched.scheduler", "Scheduler")],
}
_outcomes: dict[str, str] = {}
_deselected: dict[str, int] = {}


def _is_patched(runtime: str, cls: type) -> bool:
    if runtime == "sglang":
        return getattr(cls, "_kvcached_broker_owner", None) is cls
    return any(getattr(member, "__kvcached_broker_wrapped__", False) for member in vars(cls).values())


def _patches_on() -> bool:
    value = os.environ.get("KVCACHED_UPSTREAM_PATCHES", "on")
    if value not in ("on", "off"):
        raise pytest.UsageError(f"KVCACHED_UPSTREAM_PATCHES={value!r}: expected on or off")
    return value == "on"


def _cpu_configs_without_triton_cpu(runtime: str) -> None:
    """vLLM 0.34 refuses a CPU ``VllmConfig`` on x86 unless Triton has a CPU backend (triton-cpu,
    for its CPU model runner).  Upstream's block-pool tests only build configs and run no kernel:
    a check that refuses for that reason alone runs again with Triton (the base's, no driver
    here) counted as present, in both runs alike; nothing else sees Triton."""
    if runtime != "vllm" or importlib.util.find_spec("triton") is None:
        return
    from vllm.platforms import cpu

    check = vars(cpu.CpuPlatform).get("check_and_update_config")
    if not isinstance(check, classmethod):
        return

    def check_and_update_config(cls, vllm_config):
        try:
            return check.__func__(cls, vllm_config)
        except RuntimeError as exc:
            if "requires Triton" not in str(exc):
                raise
        import vllm.triton_utils

        saved = vllm.triton_utils.HAS_TRITON
        vllm.triton_utils.HAS_TRITON = True
        try:
            return check.__func__(cls, vllm_config)
        finally:
            vllm.triton_utils.HAS_TRITON = saved

    cpu.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def pytest_configure(config: pytest.Config) -> None:
    runtime = os.environ.get("KVCACHED_UPSTREAM_RUNTIME", "")
    if runtime not in PATCHED:
        raise pytest.UsageError(f"KVCACHED_UPSTREAM_RUNTIME={runtime!r}: expected one of {sorted(PATCHED)}")
    _cpu_configs_without_triton_cpu(runtime)
    if _patches_on():
        os.environ.setdefault("KVCACHED_BROKER", "off")  # upstream's tests never reach a broker
        from kvcached_broker.adapters import autopatch

        autopatch.apply([runtime])
    patched = [f"{module_name}.{class_name}" for module_name, class_name in PATCHED[runtime]
               if _is_patched(runtime, getattr(importlib.import_module(module_name), class_name))]
    if bool(patched) != _patches_on():
        names = ", ".join(f"{m}.{c}" for m, c in PATCHED[runtime])
        raise pytest.UsageError(f"adapter patches {'ON' if _patches_on() else 'OFF'}, but patched: "
                                f"{', '.join(patched) or 'none'} (of {names})")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = json.loads(os.environ.get("KVCACHED_UPSTREAM_DESELECT") or "{}")
    keep, drop = [], []
    for item in items:
        entry = item.nodeid.split("[", 1)[0]
        if entry in wanted:
            _deselected[entry] = _deselected.get(entry, 0) + 1
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_report_header(config: pytest.Config) -> str:
    return f"kvcached-broker: upstream tests, adapter patches {'ON' if _patches_on() else 'OFF'}"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # a test's outcome: its call's, unless its setup or teardown did not pass
    if (report.when == "call" or report.outcome != "passed") and (
            report.nodeid not in _outcomes or report.outcome != "passed"):
        _outcomes[report.nodeid] = report.outcome


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("KVCACHED_UPSTREAM_OUTCOMES")
    if path:
        with open(path, "w") as f:
            json.dump({"outcomes": _outcomes, "deselected": _deselected, "applied": _applied()}, f,
                      indent=1, sort_keys=True)


def _applied() -> list[str]:
    """The adapter patches that applied in this run (none with the patches off)."""
    if not _patches_on():
        return []
    from kvcached_broker.adapters import patching

    return sorted({result.patch for result in patching.results() if result.outcome == "applied"})
