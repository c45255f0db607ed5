"""kvcached mode for vLLM: kvcached 0.1.6's real Python code with the overlay's real vLLM classes.

The harness of the kvcached-mode modules beside vLLM's other adapter tests (``test_tp_broadcast``,
``test_prefix_eviction``, ``test_board_lifetime``, ``test_coexistence``, ``test_kvcached_vllm_range``),
which import its fixtures (``overlay``, autouse, with them); which overlay they run in is their
``runtime("kvcached", "vllm")`` marker.

They run in the combined overlays ``kvcached+vllm-0.19.1`` and ``kvcached+vllm-0.30.0`` (the table
of supported releases, adapters/support.py; scripts/test-adapters.sh: vLLM's overlay, its common
packages and kvcached's Python code on one path) and are skipped elsewhere; kv_model.py lays the
test model out as kvcached's integration for that vLLM does.  Only
``kvcached.vmm_ops`` is a double (``kvcached_broker.tools.kvcached_sim``); every engine and
worker is its own process, each worker on its own simulated GPU with its own real broker.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import require_kvcached_mode

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tp_harness import Broker, Gpu, Processes


@pytest.fixture(scope="session", autouse=True)
def overlay() -> str:
    """vLLM and kvcached at the overlay's versions (a missing one fails inside the overlay)."""
    return require_kvcached_mode("vllm", "vLLM")


@pytest.fixture
def gpus(short_tmp):
    """``make(n)``: n simulated GPUs of ``total`` each, every one with its own broker (at its default headroom, 5%)."""
    started: list[Broker] = []

    def make(n: int, total: str = "1GiB") -> list[Gpu]:
        made = []
        for index in range(n):
            workdir = short_tmp / f"gpu{index}"
            workdir.mkdir()
            usage = workdir / "usage"
            broker = Broker(workdir, total, usage).start()
            started.append(broker)
            made.append(Gpu(broker, usage, short_tmp))
        return made

    yield make
    for broker in started:
        broker.stop()


@pytest.fixture
def processes(request, short_tmp):
    running = Processes(short_tmp)
    yield running
    running.stop_all()
    if getattr(request.node, "call_failed", False):  # (tests/adapters/vllm/conftest.py) what the processes and brokers said
        for path in sorted(short_tmp.rglob("*.err")) + sorted(short_tmp.rglob("broker.log")):
            tail = path.read_text(errors="replace")[-6000:]
            print(f"===== {path.relative_to(short_tmp)} (tail) =====\n{tail}")
