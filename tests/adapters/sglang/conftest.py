"""SGLang adapter tests: real SGLang classes from the overlay, real brokers, real processes.

``TRITON_INTERPRET=1`` is set before anything imports triton: SGLang 0.5.12-0.5.13 always
launch Triton kernels in ``alloc_extend``/``alloc_decode``, and the interpreter runs them on
CPU tensors (0.5.23 takes its torch-native path on CPU either way).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/adapters: device_usage

import pytest
from helpers import connect_to, require_runtime  # tests import connect_to from here

from kvcached_broker.adapters import process_state, sessions

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session", autouse=True)
def sglang_version() -> str:
    """The overlay's SGLang version (outside an overlay run, every test here is skipped)."""
    found = require_runtime("sglang")
    logging.getLogger("sglang").setLevel(logging.ERROR)
    return found


@pytest.fixture(scope="session")
def patched_sglang(sglang_version):
    """Apply the adapter explicitly, then import the hooked SGLang modules (results so far)."""
    from kvcached_broker.adapters import autopatch

    autopatch.apply(["sglang"])
    import sglang.srt.mem_cache.allocator
    import sglang.srt.mem_cache.deepseek_v4_memory_pool

    import sglang_cpu

    if sglang_cpu.at_least("0.5.16"):
        import sglang.srt.mem_cache.kv_cache_configurator
    else:
        import sglang.srt.model_executor.model_runner_kv_cache_mixin
    if sglang_cpu.at_least("0.5.13"):
        import sglang.srt.managers.scheduler_components.weight_updater
    else:
        import sglang.srt.managers.scheduler_update_weights_mixin  # noqa: F401
    return autopatch.apply(["sglang"])


@pytest.fixture
def adapter_state(monkeypatch):
    """A clean adapter: no session, no reporters; the instance is named ``under-test``."""
    from kvcached_broker.adapters.sglang import reporting

    monkeypatch.setenv("KVCACHED_BROKER_INSTANCE", "under-test")
    process_state.reset()
    reporting.reset()
    yield
    process_state.reset()
    reporting.reset()
    sessions.set_client_factory(None)


@pytest.fixture
def sg_broker(inproc_factory, adapter_state, patched_sglang):
    """An in-process broker on a simulated 1 GiB GPU that this process's adapter talks to."""
    from helpers import GIB

    b = inproc_factory(total_bytes=GIB)
    sessions.set_client_factory(connect_to(b.endpoint))
    return b


@pytest.fixture
def measured(sg_broker):
    """The simulated GPU measures this process's usage, as NVML would (cleared afterwards)."""
    from device_usage import MeasuredUsage

    usage = MeasuredUsage(sg_broker.endpoint)
    yield usage
    usage.clear()
