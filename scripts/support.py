#!/usr/bin/env python3
"""The table of supported releases (adapters/support.py), for the shell scripts.

    support.py overlays                 the serving runtimes' overlays, in build order (scripts/adapter-envs.sh
                                        builds them from their pins; kvcached's is scripts/fetch-kvcached.py)
    support.py test-overlays            every overlay (scripts/test-adapters.sh without a list)
    support.py newest-overlays          what `make test-adapters` runs: each runtime's newest overlay
    support.py matrix-overlays          what `make test-matrix` runs: every other overlay
    support.py newest-serving           the serving runtimes' newest overlays (`make adapter-envs-newest` builds them)
    support.py suite OVERLAY            the test paths OVERLAY's adapter suite runs
    support.py check-modules OVERLAY    the modules that must import in OVERLAY (adapter-envs.sh --check)
    support.py kvcached-overlay         kvcached's overlay (scripts/fetch-kvcached.py builds it)
    support.py range RUNTIME            the supported range, e.g. >=0.19.1,<0.35

Any Python 3.10+ runs it: the table is read from this checkout's ``adapters/`` (with
``adapters/versions.py``) by path, without importing the package or a runtime.  An unknown name
is one line on stderr and status 2.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_PACKAGE = "_kvcached_broker_support"

#: Modules every overlay of a runtime must import, by the layout gate that brings or removes them.
_CHECK = {
    "sglang": ["sglang.srt.mem_cache.deepseek_v4_memory_pool", "sglang.srt.mem_cache.allocator",
               "sglang.srt.mem_cache.memory_pool", "sglang.srt.model_executor.pool_configurator",
               "sglang.srt.model_executor.model_runner"],
    "vllm": ["vllm.v1.core.block_pool", "vllm.v1.core.kv_cache_manager", "vllm.v1.kv_cache_interface",
             "vllm.v1.request", "vllm.v1.worker.utils", "vllm.v1.worker.gpu.attn_utils", "vllm.v1.worker.gpu_worker"],
}
_CHECK_FROM = {("vllm", "hisparse"): ["vllm.v1.hisparse.binding"],
               ("vllm", "extensible_kv_cache"): ["vllm.v1.worker.extensible_kv_cache"]}
_CHECK_BEFORE = {("vllm", "v2_runner_only"): ["vllm.v1.worker.gpu_model_runner"]}


def table() -> types.ModuleType:
    """``adapters/support.py`` of this checkout, loaded by path (its sibling ``versions`` with it)."""
    if _PACKAGE not in sys.modules:
        package = types.ModuleType(_PACKAGE)
        package.__path__ = [str(ROOT / "adapters")]
        sys.modules[_PACKAGE] = package
    return importlib.import_module(f"{_PACKAGE}.support")


def check_modules(name: str) -> list[str]:
    support = table()
    overlay = support.find_overlay(name)
    runtime = support.runtime(overlay.runtime)
    modules = list(_CHECK.get(runtime.name, []))
    for (owner, gate), more in _CHECK_FROM.items():
        if owner == runtime.name and runtime.at_least(gate, overlay.version):
            modules += more
    for (owner, gate), more in _CHECK_BEFORE.items():
        if owner == runtime.name and not runtime.at_least(gate, overlay.version):
            modules += more
    return modules


def main(argv: list[str]) -> int:
    support = table()
    command, args = (argv[0], argv[1:]) if argv else ("", [])
    try:
        if command == "overlays" and not args:
            print(" ".join(o.name for o in support.overlays() if o.runtime in support.SERVING))
        elif command == "test-overlays" and not args:
            print(" ".join(support.test_overlays()))
        elif command == "newest-overlays" and not args:
            print(" ".join(support.newest_overlays()))
        elif command == "matrix-overlays" and not args:
            print(" ".join(support.matrix_overlays()))
        elif command == "newest-serving" and not args:
            print(" ".join(support.newest_serving_overlays()))
        elif command == "suite" and len(args) == 1:
            suite = (support.kvcached_mode_suite(args[0]) if args[0].startswith("kvcached+")
                     else support.find_overlay(args[0]).suite)
            print(" ".join(suite))
        elif command == "check-modules" and len(args) == 1:
            print(" ".join(check_modules(args[0])))
        elif command == "kvcached-overlay" and not args:
            print(support.KVCACHED.overlays[0].name)
        elif command == "range" and len(args) == 1:
            print(support.runtime(args[0]).supported)
        else:
            print(__doc__.split("\n\n")[1], file=sys.stderr)
            return 2
    except KeyError as exc:
        print(f"support.py: {exc.args[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
