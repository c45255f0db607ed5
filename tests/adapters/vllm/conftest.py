"""vLLM adapter tests: real vLLM classes from the overlay, real brokers, patches applied once.

Each test gets a fresh adapter state: the worker's broker session points at the test's
broker, and no session survives it.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
from helpers import connect_to, require_runtime  # tests import connect_to from here

from kvcached_broker.adapters import process_state, sessions

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/adapters: device_usage


@pytest.fixture(scope="session", autouse=True)
def vllm_version() -> str:
    """The overlay's vLLM version (outside an overlay run, every test here is skipped)."""
    found = require_runtime("vllm")
    logging.getLogger("vllm").setLevel(logging.ERROR)
    return found


@pytest.fixture(scope="session")
def patched_vllm(vllm_version):
    """Import every vLLM module this release's patches hook and apply them (idempotent)."""
    import importlib

    from kvcached_broker.adapters import autopatch
    from kvcached_broker.adapters.vllm import patches

    for patch in patches.layout_patches(vllm_version):
        if patch.module.startswith("vllm."):
            importlib.import_module(patch.module)
    return autopatch.apply(["vllm"])


@pytest.fixture
def adapter_state(monkeypatch):
    """Reset the worker session around a test."""
    monkeypatch.setenv("KVCACHED_BROKER_INSTANCE", "vllm-test")
    yield
    process_state.reset()
    sessions.set_client_factory(None)


@pytest.fixture
def gpu_broker(inproc_factory, adapter_state):
    """A simulated 1 GiB GPU whose broker this process's vLLM worker session talks to."""
    from helpers import GIB

    b = inproc_factory(total_bytes=GIB)
    sessions.set_client_factory(connect_to(b.endpoint))
    return b


@pytest.fixture
def measured(gpu_broker):
    """The simulated GPU measures this process's usage, as NVML would (cleared afterwards)."""
    from device_usage import MeasuredUsage

    usage = MeasuredUsage(gpu_broker.endpoint)
    yield usage
    usage.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Whether a test's call failed (``item.call_failed``): kvcached mode's ``processes`` fixture
    (kvcached_vllm_harness.py) then prints what its processes and brokers said."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.call_failed = report.failed
