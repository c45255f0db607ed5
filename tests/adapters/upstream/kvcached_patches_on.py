"""A pytest plugin that runs upstream's own tests with the adapter's patches on, or off.

``scripts/upstream-tests.sh`` runs the upstream test files fetched into
``.adapter-envs/upstream/<overlay>`` twice with this plugin (``-p kvcached_patches_on``):
once with ``KVCACHED_UPSTREAM_PATCHES=off`` and once with ``on``, and fails if any test's
outcome differs.  The upstream files are pinned to a commit that need not be the overlay's
release, so a test that fails for a version reason fails in both runs; what must never
happen is a test that passes without the patches and not with them (a double free that no
longer reaches ``SGLANG_DEBUG_MEMORY_POOL``'s check, say).

With the patches on, the plugin applies them before any test is collected and refuses to
run if the class upstream's tests build is not the adapter's.  Each test's outcome is
written to ``KVCACHED_UPSTREAM_OUTCOMES`` (JSON: node id -> passed/failed/skipped).
"""

from __future__ import annotations

import importlib
import json
import os

import pytest

#: runtime -> (module, class name): the class upstream's tests construct, which must be ours
PATCHED = {
    "sglang": ("sglang.srt.mem_cache.allocator", "PagedTokenToKVPoolAllocator"),
    "vllm": ("vllm.v1.core.block_pool", "BlockPool"),
}
_outcomes: dict[str, str] = {}


def _is_patched(runtime: str, cls: type) -> bool:
    if runtime == "sglang":
        return getattr(cls, "_kvcached_broker_owner", None) is cls
    return all(getattr(getattr(cls, name), "__kvcached_broker_wrapped__", False)
               for name in ("get_new_blocks", "free_blocks", "get_num_free_blocks"))


def _patches_on() -> bool:
    value = os.environ.get("KVCACHED_UPSTREAM_PATCHES", "on")
    if value not in ("on", "off"):
        raise pytest.UsageError(f"KVCACHED_UPSTREAM_PATCHES={value!r}: expected on or off")
    return value == "on"


def pytest_configure(config: pytest.Config) -> None:
    runtime = os.environ.get("KVCACHED_UPSTREAM_RUNTIME", "")
    if runtime not in PATCHED:
        raise pytest.UsageError(f"KVCACHED_UPSTREAM_RUNTIME={runtime!r}: expected one of {sorted(PATCHED)}")
    module_name, class_name = PATCHED[runtime]
    if _patches_on():
        os.environ.setdefault("KVCACHED_BROKER", "off")  # upstream's tests never reach a broker
        from kvcached_broker.adapters import autopatch

        autopatch.apply([runtime])
    cls = getattr(importlib.import_module(module_name), class_name)
    if _is_patched(runtime, cls) != _patches_on():
        raise pytest.UsageError(f"{module_name}.{class_name}: patched={_is_patched(runtime, cls)}, wanted {_patches_on()}")


def pytest_report_header(config: pytest.Config) -> str:
    return f"kvcached-broker: upstream tests, adapter patches {'ON' if _patches_on() else 'OFF'}"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or report.outcome != "passed":
        if report.nodeid not in _outcomes or report.outcome != "passed":
            _outcomes[report.nodeid] = report.outcome


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("KVCACHED_UPSTREAM_OUTCOMES")
    if path:
        with open(path, "w") as f:
            json.dump(_outcomes, f, indent=1, sort_keys=True)
