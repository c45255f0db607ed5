"""A simulated GPU shared by processes: what one process allocates, the broker measures and
every other process sees as gone, like NVML and cudaMemGetInfo on a real GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvcached_broker.client import BrokerClient
from kvcached_broker.tools.shared_gpu import DeviceFull, SharedGpu

from helpers import GIB, wait_for

CHILD = """
import sys
from kvcached_broker.tools.shared_gpu import SharedGpu
gpu = SharedGpu(sys.argv[1], int(sys.argv[2]))
gpu.allocate(int(sys.argv[3]))
print("allocated", flush=True)
sys.stdin.readline()
"""


def test_one_process_allocation_is_another_one_missing_memory(broker_factory):
    usage = broker_factory.workdir / "gpu-usage"
    b = broker_factory(simulate="16GiB", extra_args=["--headroom", "0", "--simulate-usage-dir", str(usage)])
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(usage), str(16 * GIB), str(10 * GIB)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "allocated"
        me = SharedGpu(usage, 16 * GIB)
        assert me.free_bytes() == 6 * GIB
        with pytest.raises(DeviceFull):
            me.allocate(7 * GIB)
        # the broker measures the child (unregistered: external) and me (registered, unreported)
        me.allocate(2 * GIB)
        with BrokerClient.connect("me", endpoint=b.endpoint, page_bytes=GIB, credit_pages=0) as c:
            status = wait_for(lambda: (lambda s: s if s["external_bytes"] == 10 * GIB and s["unreported_bytes"] == 2 * GIB else None)(b.status()),
                              what="the broker to measure both processes")
            assert status["free_bytes"] == 4 * GIB
            assert c.reserve({}, measured_base=True) == {"runtime_base": 2 * GIB}  # what it had, pinned
            assert c.acquire(5) == 0 and c.acquire(4) == 4
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    wait_for(lambda: me.free_bytes() == 14 * GIB, what="a dead process's memory to be free")
