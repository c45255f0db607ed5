"""Fixtures of kvcached mode's tests: real kvcached 0.1.6 Python code in real processes, a real broker.

The tests that use them are marked ``runtime("kvcached")``: they run inside the ``kvcached-0.1.6``
overlay (scripts/test-adapters.sh; the overlay is fetched by scripts/fetch-kvcached.py); the
rest of this folder (the state core, the policy, the board, the segments) runs in the core
suite, kvcached not needed.  Every pool lives in its own
process (``kvcached_broker.tools.kvcached_sim.pool_process``) on one shared simulated GPU
(``serve --simulate-usage-dir``); see kv_harness.py for the sampler that checks mapped against
granted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kv_harness import PoolProcess, Sampler


@pytest.fixture
def shared_gpu(broker_factory):
    """A broker on a simulated GPU that processes share, at its default headroom (5%: kvcached keeps as
    much physically free, so a tighter broker would grant pages kvcached will not map), and its usage
    directory."""

    def make(total: str = "2GiB", **kwargs):
        usage = broker_factory.workdir / "gpu-usage"
        broker = broker_factory(simulate=total, extra_args=["--headroom", "5%", "--simulate-usage-dir", str(usage)],
                                **kwargs)
        return broker, usage

    return make


@pytest.fixture
def pools():
    started: list[PoolProcess] = []

    def start(*args, **kwargs) -> PoolProcess:
        pool = PoolProcess.start(*args, **kwargs)
        started.append(pool)
        return pool

    yield start
    for pool in started:
        pool.stop()


@pytest.fixture
def sampler_for():
    def make(broker, usage: Path) -> Sampler:
        return Sampler(broker, usage)

    return make


@pytest.fixture
def inproc_pools(short_tmp, monkeypatch, inproc_factory):
    """Governed pools in this process (inproc_pool.py): the broker's kvcached patch applied, and
    undone after the test; an in-process 2 GiB broker; this process's adapter session."""
    from inproc_pool import inproc_pools as body

    yield from body(short_tmp, monkeypatch, inproc_factory)
